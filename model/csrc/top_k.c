/* Kernels over rows of logits. row_top_k: the k largest logits of each row, with the row's
 * log-sum-exp: what a greedy step (k = 1) and a beam search step (k = 2 x beam size) need of a
 * (rows, vocab) block of logits, in one pass over it instead of torch's argmax, log_softmax and
 * top-k over the whole vocabulary (each a pass, the first two not vectorised on the CPU). row_draw:
 * each row's sampled token, in two passes. Built and loaded by decoding/top_k_cpu.py. */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 64 /* elements whose maximum is compared with the k-th best before they are looked at */

/* exp(x) for x <= 0 (a logit less the row's largest), within 3e-7 of it (relative) above -87, and
 * about 1.6e-38 below (exp(-87)): 2^n p(r) with Cephes' polynomial, in operations that vectorise
 * (glibc's vector expf takes about twice as long here). */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);        /* x = n ln 2 + r, |r| <= ln 2 / 2 */
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f; /* ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23; /* times 2^n: n added to the exponent */
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* Puts x (id i) among the row's `count` best (values descending; of equal values the lower id first,
 * as ids arrive ascending), keeping at most k. */
static inline int64_t insert(float *values, int64_t *ids, int64_t count, int64_t k, float x, int64_t i) {
    int64_t at = count < k ? count : k - 1;
    while (at > 0 && values[at - 1] < x) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    values[at] = x;
    ids[at] = i;
    return count < k ? count + 1 : count;
}

/* logits (n, vocab) contiguous, without NaN, vocab >= k >= 1; row_index (rows,): the rows to read,
 * in order (NULL: rows 0 .. rows - 1). Writes values, ids (rows, k): each such row's k largest
 * logits and their ids, best first; lse (rows,), unless NULL: log(sum(exp(row))), -inf for a row
 * of -inf only; poisoned, unless NULL: 1 when a row read holds a NaN or +inf (whose results are
 * then not its top k: the caller reads a cleaned copy), else 0. Returns 0; -1 when k is out of
 * range, -2 when out of memory.
 *
 * A row is read in chunks: first each chunk's largest logit (a vectorised pass), then only the
 * chunks whose largest is at least the k-th largest of those, element by element, in order. The
 * k-th largest chunk maximum is a lower bound of the row's k-th largest logit (k chunks hold one at
 * least as large each), so every logit of the k best is in a chunk that is read. */
int row_top_k(const float *logits, const int64_t *row_index, int64_t rows, int64_t vocab, int64_t k, float *values, int64_t *ids,
              float *lse, int64_t *poisoned) {
    if (k < 1 || k > vocab) return -1;
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    float *chunk_top = malloc(sizeof(float) * (size_t)(chunks + k)); /* each chunk's largest, then the k largest of those */
    int64_t *unused = malloc(sizeof(int64_t) * (size_t)k);
    if (chunk_top == NULL || unused == NULL) {
        free(chunk_top);
        free(unused);
        return -2;
    }
    float *bound = chunk_top + chunks;
    uint32_t special = 0; /* a NaN or +inf seen: an exponent of all ones, other than -inf's */
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + (row_index == NULL ? r : row_index[r]) * vocab;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t first = c * CHUNK, n = vocab - first < CHUNK ? vocab - first : CHUNK;
            float top = -INFINITY;
#pragma omp simd reduction(max : top) reduction(| : special)
            for (int64_t j = 0; j < n; j++) {
                uint32_t bits;
                memcpy(&bits, &row[first + j], sizeof bits);
                special |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u && bits != 0xff800000u);
                top = row[first + j] > top ? row[first + j] : top;
            }
            chunk_top[c] = top;
        }
        float threshold = -INFINITY; /* every chunk is read when there are at most k */
        if (chunks > k) {
            int64_t count = 0;
            for (int64_t c = 0; c < chunks; c++)
                if (count < k || chunk_top[c] > bound[k - 1]) count = insert(bound, unused, count, k, chunk_top[c], c);
            threshold = bound[k - 1];
        }
        float *best = values + r * k;
        int64_t *best_ids = ids + r * k, count = 0;
        for (int64_t c = 0; c < chunks; c++) {
            if (chunk_top[c] < threshold) continue;
            const int64_t first = c * CHUNK, last = first + CHUNK < vocab ? first + CHUNK : vocab;
            for (int64_t i = first; i < last; i++)
                if (count < k || row[i] > best[k - 1]) count = insert(best, best_ids, count, k, row[i], i);
        }
        if (lse == NULL) continue;
        const float top = best[0];
        if (!(top > -INFINITY)) { /* every logit -inf */
            lse[r] = top;
            continue;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < vocab; j++) sum += exp_nonpositive(row[j] - top);
        lse[r] = top + logf(sum);
    }
    if (poisoned != NULL) *poisoned = special != 0;
    free(chunk_top);
    free(unused);
    return 0;
}

#define DRAW_CHUNK 1024 /* logits whose weights row_draw sums together: its search finds a chunk, then the token in it */

/* A logit's weight: exp((x - top) / temperature), as `scale` = 1 / temperature, and exactly 0 for
 * -inf (a masked token: never drawn), tested on its bits, which -ffast-math leaves alone. */
static inline float draw_weight(float x, float top, float scale) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const float weight = exp_nonpositive((x - top) * scale);
    return bits == 0xff800000u ? 0.0f : weight;
}

/* logits (rows, vocab) contiguous, vocab >= 1; temperature (rows,) > 0, uniform (rows,) in [0, 1).
 * Each row's draw from softmax(row / temperature): the first token whose cumulative weight passes
 * uniform x the row's total weight (weights from draw_weight). Two passes over a row: its largest
 * logit, then each DRAW_CHUNK's sum of weights, then the weights of the one chunk the target falls
 * in, cumulated in order. Writes tokens (rows,), weights (rows,): the drawn token's weight (0 when
 * rounding put the target past the chunk's last token of weight above 0 and none is left: the
 * caller's fallback), totals (rows,): the row's total weight, NaN for a row with a NaN or +inf logit
 * or of -inf only (its token and weight then 0). Returns 0, or -2 when out of memory. */
int row_draw(const float *logits, int64_t rows, int64_t vocab, const float *temperature, const float *uniform, int64_t *tokens,
             float *weights, float *totals) {
    const int64_t chunks = (vocab + DRAW_CHUNK - 1) / DRAW_CHUNK;
    float *sums = malloc(sizeof(float) * (size_t)chunks);
    if (sums == NULL) return -2;
    const uint32_t nan_bits = 0x7fc00000u;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * vocab;
        float top = -INFINITY;
        uint32_t special = 0; /* a NaN or +inf seen: an exponent of all ones, other than -inf's */
#pragma omp simd reduction(max : top) reduction(| : special)
        for (int64_t j = 0; j < vocab; j++) {
            uint32_t bits;
            memcpy(&bits, &row[j], sizeof bits);
            special |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u && bits != 0xff800000u);
            top = row[j] > top ? row[j] : top;
        }
        tokens[r] = 0;
        weights[r] = 0.0f;
        memcpy(&totals[r], &nan_bits, sizeof nan_bits);
        if (special) continue;
        const float scale = 1.0f / temperature[r];
        float total = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t first = c * DRAW_CHUNK, n = vocab - first < DRAW_CHUNK ? vocab - first : DRAW_CHUNK;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) sum += draw_weight(row[first + j], top, scale);
            sums[c] = sum;
            total += sum;
        }
        /* A row of -inf only has no weight (its largest may read -FLT_MAX: -ffast-math's max
         * reduction starts there); any finite logit gives the largest weight 1. */
        if (!(total > 0.0f)) continue;
        totals[r] = total;
        const float target = uniform[r] * total;
        int64_t c = 0;
        float before = 0.0f; /* the cumulative weight at chunk c's start */
        while (c < chunks - 1 && before + sums[c] <= target) before += sums[c++];
        const int64_t first = c * DRAW_CHUNK, last = first + DRAW_CHUNK < vocab ? first + DRAW_CHUNK : vocab;
        float cumulative = before;
        for (int64_t i = first; i < last; i++) {
            const float weight = draw_weight(row[i], top, scale);
            if (weight > 0.0f) { /* the last token of weight above 0 so far: where rounding's overshoot ends */
                tokens[r] = i;
                weights[r] = weight;
            }
            cumulative += weight;
            if (cumulative > target && weight > 0.0f) break;
        }
    }
    free(sums);
    return 0;
}
