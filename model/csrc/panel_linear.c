/* Linear layers of a few rows on the CPU, float32: y = x W^T + b for the 1 to 16 rows of a decode
 * step, reading the weight once, at memory speed, from a panel layout: W (out, in) cut into panels
 * of PANEL output columns, each stored (in, PANEL) contiguous, the last zero-padded. A panel's 64
 * columns are 4 vectors of 16 floats; 4 rows at a time accumulate 16 vectors in registers, so the
 * panel (147 KB for in = 576) is read from memory for the first 4 rows and from the L2 cache for
 * the rest. Written with gcc's vector extensions: AVX-512 with -march=native where the CPU has it,
 * AVX2 or NEON otherwise. Built and loaded by model/cpu_kernels.py; used by model/packed_linear.py. */
#include <stdint.h>
#include <string.h>

#define PANEL 64
#define LANES 16
#define ROW_GROUP 4

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
        const vec w0 = *(const unaligned_vec *)w, w1 = *(const unaligned_vec *)(w + LANES),
                  w2 = *(const unaligned_vec *)(w + 2 * LANES), w3 = *(const unaligned_vec *)(w + 3 * LANES);
        for (int r = 0; r < R; r++) {
            const float xk = x[r * in + k];
            acc[r][0] += xk * w0;
            acc[r][1] += xk * w1;
            acc[r][2] += xk * w2;
            acc[r][3] += xk * w3;
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
            default: panel_rows(4, xr, panel, bias, yr, in, out, column, width); break;
            }
        }
    }
}
