/* Linear layers of a few rows on the CPU, float32: y = x W^T + b for the 1 to 128 rows of a decode
 * step, reading the weight once, at memory speed, from a panel layout: W (out, in) cut into panels
 * of PANEL output columns, each stored (in, PANEL) contiguous, the last zero-padded. A panel's 32
 * columns are 2 vectors of 16 floats; up to 8 rows at a time accumulate 16 vectors in registers,
 * so at 8 rows each weight read from memory feeds as many multiply-adds as the memory's speed
 * allows, and rows past 8 read the panel (74 KB for in = 576) again from the L2 cache. Written with
 * gcc's vector extensions: AVX-512 with -march=native where the CPU has it, AVX2 or NEON otherwise.
 * Built and loaded by model/cpu_kernels.py; used by model/packed_linear.py. */
#include <stdint.h>
#include <string.h>

#define PANEL 32
#define LANES 16
#define ROW_GROUP 8

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
            switch (rows - r) { /* a constant R in each call: the row loops unroll, acc stays in registers */
            case 1: panel_rows(1, xr, panel, bias, yr, in, out, column, width); break;
            case 2: panel_rows(2, xr, panel, bias, yr, in, out, column, width); break;
            case 3: panel_rows(3, xr, panel, bias, yr, in, out, column, width); break;
            case 4: panel_rows(4, xr, panel, bias, yr, in, out, column, width); break;
            case 5: panel_rows(5, xr, panel, bias, yr, in, out, column, width); break;
            case 6: panel_rows(6, xr, panel, bias, yr, in, out, column, width); break;
            case 7: panel_rows(7, xr, panel, bias, yr, in, out, column, width); break;
            default: panel_rows(ROW_GROUP, xr, panel, bias, yr, in, out, column, width); break;
            }
        }
    }
}
