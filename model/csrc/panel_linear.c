/* Linear layers of a few rows on the CPU, float32: y = x W^T + b for the 1 to 128 rows of a decode
 * step, reading the weight once, at memory speed, from a panel layout: W (out, in) cut into panels
 * of PANEL output columns, each stored (in, PANEL) contiguous, the last zero-padded. A panel's 32
 * columns are PANEL / LANES vectors of the CPU's width; ROW_GROUP rows at a time accumulate
 * ROW_GROUP x PANEL / LANES vectors in registers (with AVX-512, 8 rows in 16 of its 32), so each
 * weight read from memory feeds several multiply-adds, and rows past the group read the panel
 * (74 KB for in = 576) again from the L2 cache. Written with gcc's vector extensions, built with
 * -march=native. Vectors wider than the CPU's, or accumulators past its registers, are split and
 * spilled to the stack: 16-float vectors on an AVX2 CPU (AMD EPYC Zen 3) ran at 2 GFLOP/s, 8-float
 * ones at 25-64 (docs/performance.md). Built and loaded by model/cpu_kernels.py; used by
 * model/packed_linear.py. */
#include <stdint.h>
#include <string.h>

#define PANEL 32
#if defined(__AVX512F__) /* 32 registers of 16 floats */
#define LANES 16
#define ROW_GROUP 8
#elif defined(__AVX__) /* 16 registers of 8 floats */
#define LANES 8
#define ROW_GROUP 3
#elif defined(__aarch64__) /* NEON: 32 registers of 4 floats */
#define LANES 4
#define ROW_GROUP 3
#else /* SSE: 16 registers of 4 floats */
#define LANES 4
#define ROW_GROUP 1
#endif
_Static_assert(ROW_GROUP == 1 || ROW_GROUP == 3 || ROW_GROUP == 8, "panel_linear's switch has cases for groups of 1, 3 and 8 rows");

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float unaligned_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));

/* Columns [column, column + width) of rows 0..R-1: y[r, c] = bias[c] + sum_k x[r, k] panel[k, c - column]. */
static inline __attribute__((always_inline)) void panel_rows(int R, const float *x, const float *panel, const float *bias,
                                                             float *y, int64_t in, int64_t out, int64_t column, int64_t width) {
    vec acc[ROW_GROUP][PANEL / LANES];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PANEL / LANES; j++) acc[r][j] = (vec){0};
    const float *w = panel;
    for (int64_t k = 0; k < in; k++, w += PANEL) {
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
        memcpy(y + r * out + column, sums, sizeof(float) * (size_t)width);
    }
}

/* y (rows, out) = x (rows, in) W^T + bias (out, or NULL), W given as panels (ceil(out / PANEL), in,
 * PANEL), all contiguous. */
void panel_linear(const float *x, const float *panels, const float *bias, float *y, int64_t rows, int64_t in, int64_t out) {
    for (int64_t column = 0; column < out; column += PANEL) {
        const float *panel = panels + column * in;
        const int64_t width = out - column < PANEL ? out - column : PANEL;
        for (int64_t r = 0; r < rows; r += ROW_GROUP) {
            const float *xr = x + r * in;
            float *yr = y + r * out;
            /* A constant R in each call: the row loops unroll, the accumulators stay in registers. */
            switch (rows - r < ROW_GROUP ? rows - r : ROW_GROUP) {
#if ROW_GROUP >= 8
            case 8: panel_rows(8, xr, panel, bias, yr, in, out, column, width); break;
            case 7: panel_rows(7, xr, panel, bias, yr, in, out, column, width); break;
            case 6: panel_rows(6, xr, panel, bias, yr, in, out, column, width); break;
            case 5: panel_rows(5, xr, panel, bias, yr, in, out, column, width); break;
            case 4: panel_rows(4, xr, panel, bias, yr, in, out, column, width); break;
#endif
#if ROW_GROUP >= 3
            case 3: panel_rows(3, xr, panel, bias, yr, in, out, column, width); break;
            case 2: panel_rows(2, xr, panel, bias, yr, in, out, column, width); break;
#endif
            default: panel_rows(1, xr, panel, bias, yr, in, out, column, width); break;
            }
        }
    }
}
