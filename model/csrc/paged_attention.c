/* Paged decode attention on the CPU, float32: one query token per sequence, attending over its
 * keys where they lie in the block pool (vLLM's PagedAttention layout, model/kv_cache.py), reading
 * each key and value once for every query head that shares it (grouped-query attention).
 * Built and loaded by model/paged_attention_cpu.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b, where K_b, V_b are the first lengths[b]
 * positions of the blocks block_tables[b, 0..] of the pools keys, values (num_blocks, block_size,
 * Hkv, D). q, out: (B, H, D) contiguous; block_tables: (B, table_stride). Query head h reads key
 * head h / (H / Hkv). Returns 0; -1 when out of memory, -2 when a length is past its row's
 * table_stride blocks, -3 when a length is below 1, -4 when a block a length reaches is not one of
 * the pools' num_blocks (nothing read or computed for -2 to -4). */
int paged_decode_attention(const float *q, const float *keys, const float *values, const int64_t *block_tables,
                           int64_t table_stride, const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t block_size, int64_t num_blocks, float scale) {
    const int64_t group = H / Hkv, token_stride = Hkv * D, block_stride = block_size * token_stride;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = lengths[b];
        if (L < 1) return -3;
        if (L > table_stride * block_size) return -2;
        for (int64_t i = 0; i < (L + block_size - 1) / block_size; i++)
            if (block_tables[b * table_stride + i] < 0 || block_tables[b * table_stride + i] >= num_blocks) return -4;
        longest = L > longest ? L : longest;
    }
    float *scores = malloc(sizeof(float) * (size_t)(H * longest + H * D));  /* (H, L), then the scaled queries (H, D) */
    if (scores == NULL) return -1;
    float *query = scores + H * longest;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = lengths[b];
        const int64_t *table = block_tables + b * table_stride;
        for (int64_t i = 0; i < H * D; i++) query[i] = q[b * H * D + i] * scale;
        /* Scores: each key token is read once, for every query head of its group. */
        for (int64_t t = 0; t < L; t++) {
            const float *key = keys + table[t / block_size] * block_stride + (t % block_size) * token_stride;
            for (int64_t h = 0; h < H; h++) {
                const float *kh = key + (h / group) * D, *qh = query + h * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[d];
                scores[h * longest + t] = dot;
            }
        }
        /* Softmax of each head's row; the normalisation is applied to the output. */
        float *o = out + b * H * D;
        memset(o, 0, sizeof(float) * (size_t)(H * D));
        float total[H];
        for (int64_t h = 0; h < H; h++) {
            float *row = scores + h * longest, top = -FLT_MAX, sum = 0.0f;
            for (int64_t t = 0; t < L; t++) top = row[t] > top ? row[t] : top;
#pragma omp simd
            for (int64_t t = 0; t < L; t++) row[t] = expf(row[t] - top);
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < L; t++) sum += row[t];
            total[h] = sum;
        }
        /* Weighted values: each value token is read once, for every query head of its group. */
        for (int64_t t = 0; t < L; t++) {
            const float *value = values + table[t / block_size] * block_stride + (t % block_size) * token_stride;
            for (int64_t h = 0; h < H; h++) {
                const float *vh = value + (h / group) * D, p = scores[h * longest + t];
                float *oh = o + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            const float inverse = 1.0f / total[h];
            for (int64_t d = 0; d < D; d++) o[h * D + d] *= inverse;
        }
    }
    free(scores);
    return 0;
}
