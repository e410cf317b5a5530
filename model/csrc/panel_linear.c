/* Linear layers of a few rows on the CPU, float32: y = x W^T + b for the 1 to 128 rows of a decode
 * step, reading the weight once, at memory speed, from a panel layout: W (out, in) cut into panels
 * of PANEL output columns, each stored (in, PANEL) contiguous, the last zero-padded. A panel's 32
 * columns are PANEL / LANES vectors of the CPU's width; ROW_GROUP rows at a time accumulate
 * ROW_GROUP x PANEL / LANES vectors in registers (with AVX-512, 8 rows in 16 of its 32), so each
 * weight read from memory feeds several multiply-adds, and rows past the group read the panel
 * (74 KB for in = 576) again from the L2 cache. Written with gcc's vector extensions, built with
 * -march=native. Vectors wider than the CPU's, or accumulators past its registers, are split and
 * spilled to the stack: 16-float vectors on an AVX2 CPU (AMD EPYC Zen 3) ran at 2 GFLOP/s, 8-float
 * ones at 25-64 (docs/performance.md).
 *
 * With AVX2, past SPLIT_ROWS rows the multiply is compute-bound, and a group of 3 rows needs 12
 * accumulators, 4 weight vectors and a broadcast, 17 of the 16 registers: gcc reads the weights
 * as memory operands of each multiply-add (15 loads for 12 multiply-adds), and the loop waits on
 * loads. There each half panel (16 columns, one 64-byte line per k) goes to groups of up to
 * HALF_ROW_GROUP = 6 rows (12 accumulators, 2 weight vectors and a broadcast: 15 registers), the
 * groups balanced (13 rows: 5, 4, 4): 84-91 GFLOP/s at 12 to 128 rows on the translator's and
 * generator's shapes where the 3-row groups made 65-69 (docs/performance.md).
 * panel_argmax runs the same products for a greedy step's output projection and keeps only each
 * row's argmax (1.2-1.25x at 128-256 rows of a 49,152-wide, K = 128 head on the AMD EPYC, AVX2:
 * 256 x 49,152 products are not written to memory and read again).
 * Built and loaded by model/cpu_kernels.py; used by model/packed_linear.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32
#if defined(__AVX512F__) /* 32 registers of 16 floats */
#define LANES 16
#define ROW_GROUP 8
#define PANEL_FETCH_AHEAD 32 /* k rows of a panel, 4 KB: see panel_rows */
#elif defined(__AVX__) /* 16 registers of 8 floats */
#define LANES 8
#define ROW_GROUP 3
#define HALF_ROW_GROUP 6
#define SPLIT_ROWS 8
#elif defined(__aarch64__) /* NEON: 32 registers of 4 floats */
#define LANES 4
#define ROW_GROUP 3
#else /* SSE: 16 registers of 4 floats */
#define LANES 4
#define ROW_GROUP 1
#endif
_Static_assert(ROW_GROUP == 1 || ROW_GROUP == 3 || ROW_GROUP == 8, "panel_linear's switch has cases for groups of 1, 3 and 8 rows");
#ifndef PANEL_FETCH_AHEAD
#define PANEL_FETCH_AHEAD 0 /* no prefetches: measured on AVX-512 only */
#endif
#ifdef HALF_ROW_GROUP
#define HALF (PANEL / 2)
#define FETCH_AHEAD 4 /* k rows of a panel, 512 bytes */
/* Balanced groups of at most 6 rows, when there are more than SPLIT_ROWS rows, have 4 to 6. */
_Static_assert(HALF_ROW_GROUP == 6 && SPLIT_ROWS >= 8, "half_panels' switch has cases for groups of 4 to 6 rows");
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float unaligned_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* panel_argmax's running state, per row and lane, from a group's first row: the largest product so
 * far, its column (the first of equal ones: a lane's columns arrive ascending), and whether a NaN
 * or +inf was seen (tested on the bits: -ffast-math may assume neither in comparisons). */
struct running_max {
    vec *top;       /* (rows,) */
    ivec *ids;      /* (rows,) */
    ivec *poisoned; /* (rows,) */
};

/* Folds one row's products of a panel or half panel (count vectors: columns from `column`, `width`
 * of them real) into its running maximum, instead of storing them. */
static inline __attribute__((always_inline)) void fold_max(const vec *sums, int count, int64_t column, int64_t width, vec *top, ivec *ids,
                                                          ivec *poisoned) {
    ivec lane;
    for (int l = 0; l < LANES; l++) lane[l] = l;
    for (int j = 0; j < count; j++) {
        const ivec col = lane + (int32_t)(column + j * LANES);
        const ivec valid = col < (int32_t)(column + width);
        ivec bits, top_bits;
        memcpy(&bits, &sums[j], sizeof bits);
        memcpy(&top_bits, top, sizeof top_bits);
        *poisoned |= valid & ((bits & 0x7f800000) == 0x7f800000) & (bits != (int32_t)0xff800000);
        const ivec greater = valid & (sums[j] > *top);
        top_bits = (bits & greater) | (top_bits & ~greater);
        memcpy(top, &top_bits, sizeof top_bits);
        *ids = (col & greater) | (*ids & ~greater);
    }
}

/* Columns [column, column + width) of rows 0..R-1: y[r, c] = bias[c] + sum_k x[r, k] panel[k, c - column].
 * With `fetch` (a panel's first pass, which reads it from memory) it also asks for the panel's lines
 * PANEL_FETCH_AHEAD k ahead: in a step, other reads (the attention's keys) push the weights out of
 * the caches between two steps, and on the Intel Xeon (AVX-512) the hardware's prefetchers left the
 * first pass waiting on them (a translator decoder step's products 1.11-1.25x with it,
 * docs/performance.md). */
static inline __attribute__((always_inline)) void panel_rows(int R, int fetch, const float *x, const float *panel,
                                                             const float *bias, float *y, int64_t in, int64_t out, int64_t column,
                                                             int64_t width, const struct running_max *state) {
    vec acc[ROW_GROUP][PANEL / LANES];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PANEL / LANES; j++) acc[r][j] = (vec){0};
    const float *w = panel;
    for (int64_t k = 0; k < in; k++, w += PANEL) {
        if (PANEL_FETCH_AHEAD > 0 && fetch)
            for (int line = 0; line < PANEL / 16; line++) __builtin_prefetch(w + PANEL_FETCH_AHEAD * PANEL + 16 * line);
        vec weights[PANEL / LANES];
        for (int j = 0; j < PANEL / LANES; j++) weights[j] = *(const unaligned_vec *)(w + j * LANES);
        for (int r = 0; r < R; r++) {
            const float xk = x[r * in + k];
            for (int j = 0; j < PANEL / LANES; j++) acc[r][j] += xk * weights[j];
        }
    }
    for (int r = 0; r < R; r++) {
        float sums[PANEL];
        memcpy(sums, acc[r], sizeof(sums));
        if (bias != NULL)
            for (int64_t c = 0; c < width; c++) sums[c] += bias[column + c];
        if (state != NULL) {
            vec folded[PANEL / LANES];
            memcpy(folded, sums, sizeof(folded));
            fold_max(folded, PANEL / LANES, column, width, &state->top[r], &state->ids[r], &state->poisoned[r]);
            continue;
        }
        memcpy(y + r * out + column, sums, sizeof(float) * (size_t)width);
    }
}

#ifdef HALF_ROW_GROUP
/* panel_rows for a half panel (HALF columns at w, consecutive k PANEL floats apart), R <= 6 rows. The
 * empty asm keeps the two weight vectors in registers: without it gcc reads them again, as a memory
 * operand, in every row's multiply-add (12 loads where 2 do), and the loop waits on loads. With
 * `fetch` (a panel's first pass, which reads it from memory) it also asks for both halves' lines
 * FETCH_AHEAD k ahead: a pass over half panels reads every other 64-byte line, which the hardware's
 * prefetchers follow poorly (on the AMD EPYC, from memory, 16 rows ran at 0.8x the 3-row groups
 * without it, 1.1-1.3x with it). */
static inline __attribute__((always_inline)) void half_rows(int R, int fetch, const float *x, const float *w, const float *bias, float *y,
                                                            int64_t in, int64_t out, int64_t column, int64_t width,
                                                            const struct running_max *state) {
    vec acc[HALF_ROW_GROUP][HALF / LANES];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < HALF / LANES; j++) acc[r][j] = (vec){0};
    /* Four k a loop: 1.08-1.18x a product of 16 to 256 rows over one k a loop (the AMD EPYC; the
     * loop's own counters and branch beside 12 multiply-adds, docs/performance.md). */
#pragma GCC unroll 4
    for (int64_t k = 0; k < in; k++, w += PANEL) {
        if (fetch) {
            __builtin_prefetch(w + FETCH_AHEAD * PANEL);
            __builtin_prefetch(w + FETCH_AHEAD * PANEL + HALF);
        }
        vec weights[HALF / LANES];
        for (int j = 0; j < HALF / LANES; j++) {
            weights[j] = *(const unaligned_vec *)(w + j * LANES);
            __asm__("" : "+x"(weights[j]));
        }
        for (int r = 0; r < R; r++) {
            const float xk = x[r * in + k];
            for (int j = 0; j < HALF / LANES; j++) acc[r][j] += xk * weights[j];
        }
    }
    for (int r = 0; r < R; r++) {
        if (state != NULL) {
            float sums[HALF];
            memcpy(sums, acc[r], sizeof(sums));
            if (bias != NULL)
                for (int64_t c = 0; c < width; c++) sums[c] += bias[column + c];
            vec folded[HALF / LANES];
            memcpy(folded, sums, sizeof(folded));
            fold_max(folded, HALF / LANES, column, width, &state->top[r], &state->ids[r], &state->poisoned[r]);
            continue;
        }
        if (width == HALF) { /* stored as vectors: all but a last part panel */
            for (int j = 0; j < HALF / LANES; j++) {
                vec sums = acc[r][j];
                if (bias != NULL) sums += *(const unaligned_vec *)(bias + column + j * LANES);
                *(unaligned_vec *)(y + r * out + column + j * LANES) = sums;
            }
            continue;
        }
        float sums[HALF];
        memcpy(sums, acc[r], sizeof(sums));
        if (bias != NULL)
            for (int64_t c = 0; c < width; c++) sums[c] += bias[column + c];
        memcpy(y + r * out + column, sums, sizeof(float) * (size_t)width);
    }
}

/* panel_linear for more than SPLIT_ROWS rows: each half panel in balanced groups of 4 to 6 rows. */
static void half_panels(const float *x, const float *panels, const float *bias, float *y, int64_t rows, int64_t in, int64_t out,
                        const struct running_max *state) {
    const int64_t groups = (rows + HALF_ROW_GROUP - 1) / HALF_ROW_GROUP;
    for (int64_t column = 0; column < out; column += HALF) {
        const float *w = panels + (column / PANEL) * PANEL * in + column % PANEL;
        const int64_t width = out - column < HALF ? out - column : HALF;
        for (int64_t g = 0, r = 0; g < groups; g++) {
            const int64_t n = (rows - r + groups - g - 1) / (groups - g); /* the rows left shared over the groups left */
            const float *xr = x + r * in;
            float *yr = y + r * out;
            const struct running_max at = {state ? state->top + r : NULL, state ? state->ids + r : NULL, state ? state->poisoned + r : NULL};
            const struct running_max *sr = state ? &at : NULL;
            /* fetch a constant in each call, as R: the loop is built with the prefetches and without. */
            if (g == 0 && column % PANEL == 0) /* the panel's first pass */
                switch (n) {
                case 6: half_rows(6, 1, xr, w, bias, yr, in, out, column, width, sr); break;
                case 5: half_rows(5, 1, xr, w, bias, yr, in, out, column, width, sr); break;
                default: half_rows(4, 1, xr, w, bias, yr, in, out, column, width, sr); break;
                }
            else
                switch (n) {
                case 6: half_rows(6, 0, xr, w, bias, yr, in, out, column, width, sr); break;
                case 5: half_rows(5, 0, xr, w, bias, yr, in, out, column, width, sr); break;
                default: half_rows(4, 0, xr, w, bias, yr, in, out, column, width, sr); break;
                }
            r += n;
        }
    }
}
#endif

/* panel_rows for n <= ROW_GROUP rows, R made a constant (inlined with `fetch` a constant too). */
static inline __attribute__((always_inline)) void row_group(int n, int fetch, const float *x, const float *panel, const float *bias,
                                                            float *y, int64_t in, int64_t out, int64_t column, int64_t width,
                                                            const struct running_max *state) {
    switch (n) {
#if ROW_GROUP >= 8
    case 8: panel_rows(8, fetch, x, panel, bias, y, in, out, column, width, state); break;
    case 7: panel_rows(7, fetch, x, panel, bias, y, in, out, column, width, state); break;
    case 6: panel_rows(6, fetch, x, panel, bias, y, in, out, column, width, state); break;
    case 5: panel_rows(5, fetch, x, panel, bias, y, in, out, column, width, state); break;
    case 4: panel_rows(4, fetch, x, panel, bias, y, in, out, column, width, state); break;
#endif
#if ROW_GROUP >= 3
    case 3: panel_rows(3, fetch, x, panel, bias, y, in, out, column, width, state); break;
    case 2: panel_rows(2, fetch, x, panel, bias, y, in, out, column, width, state); break;
#endif
    default: panel_rows(1, fetch, x, panel, bias, y, in, out, column, width, state); break;
    }
}

/* panel_linear, or panel_argmax's products where state is not NULL (y unused then). */
/* y (rows, out) = x (rows, in) W^T + bias (out, or NULL), W given as panels (ceil(out / PANEL), in,
 * PANEL), all contiguous. */
static void panel_product(const float *x, const float *panels, const float *bias, float *y, int64_t rows, int64_t in, int64_t out,
                          const struct running_max *state) {
#ifdef HALF_ROW_GROUP
    if (rows > SPLIT_ROWS) {
        half_panels(x, panels, bias, y, rows, in, out, state);
        return;
    }
#endif
    for (int64_t column = 0; column < out; column += PANEL) {
        const float *panel = panels + column * in;
        const int64_t width = out - column < PANEL ? out - column : PANEL;
        for (int64_t r = 0; r < rows; r += ROW_GROUP) {
            const float *xr = x + r * in;
            float *yr = y + r * out;
            /* Constant R and fetch in each call: the row loops unroll, the accumulators stay in registers. */
            const int n = rows - r < ROW_GROUP ? (int)(rows - r) : ROW_GROUP;
            const struct running_max at = {state ? state->top + r : NULL, state ? state->ids + r : NULL, state ? state->poisoned + r : NULL};
            const struct running_max *sr = state ? &at : NULL;
            if (r == 0) /* the panel's first pass */
                row_group(n, 1, xr, panel, bias, yr, in, out, column, width, sr);
            else
                row_group(n, 0, xr, panel, bias, yr, in, out, column, width, sr);
        }
    }
}

void panel_linear(const float *x, const float *panels, const float *bias, float *y, int64_t rows, int64_t in, int64_t out) {
    panel_product(x, panels, bias, y, rows, in, out, NULL);
}

/* ids (rows,) = each row's argmax of x (rows, in) W^T + bias, panels and bias as panel_linear's (the
 * same sums in the same order, never stored): the first column of the largest; poisoned (rows,): 1
 * for a row whose products hold a NaN or +inf (its id then unspecified), else 0. A greedy step's
 * output projection without its logits, which are neither written nor read again. Returns 0, or -2
 * when out of memory. */
int panel_argmax(const float *x, const float *panels, const float *bias, int64_t *ids, int64_t *poisoned, int64_t rows, int64_t in,
                 int64_t out) {
    const size_t n = (size_t)(rows > 0 ? rows : 1);
    vec *top = aligned_alloc(sizeof(vec), sizeof(vec) * n);
    ivec *best = aligned_alloc(sizeof(ivec), sizeof(ivec) * n);
    ivec *bad = aligned_alloc(sizeof(ivec), sizeof(ivec) * n);
    if (top == NULL || best == NULL || bad == NULL) {
        free(top);
        free(best);
        free(bad);
        return -2;
    }
    const uint32_t minus_infinity_bits = 0xff800000u;
    float minus_infinity;
    memcpy(&minus_infinity, &minus_infinity_bits, sizeof minus_infinity);
    for (int64_t r = 0; r < rows; r++) {
        top[r] = (vec){0} + minus_infinity;
        best[r] = (ivec){0};
        bad[r] = (ivec){0};
    }
    const struct running_max state = {top, best, bad};
    panel_product(x, panels, bias, NULL, rows, in, out, &state);
    for (int64_t r = 0; r < rows; r++) { /* across lanes: the largest, of equal ones the lowest column */
        float value = top[r][0];
        int32_t id = best[r][0], any_bad = bad[r][0];
        for (int l = 1; l < LANES; l++) {
            any_bad |= bad[r][l];
            if (top[r][l] > value || (top[r][l] == value && best[r][l] < id)) {
                value = top[r][l];
                id = best[r][l];
            }
        }
        ids[r] = id;
        poisoned[r] = any_bad != 0;
    }
    free(top);
    free(best);
    free(bad);
    return 0;
}

/* The most rows panel_linear is meant for: past them oneDNN's packed product was faster (128 rows
 * with the 3-row groups; the half panels were 1.17x oneDNN at 256 rows on the AMD EPYC,
 * docs/performance.md). model/packed_linear.py reads it. */
int64_t panel_linear_max_rows(void) {
#ifdef HALF_ROW_GROUP
    return 256;
#else
    return 128;
#endif
}
