/* Linear layers whose weights stay in GGUF's quantized blocks, float32 activations: y = x W^T + b
 * for the few rows of a decode step, each weight row read once as it lies in the file. W (out, in)
 * is `out` rows of in / BLOCK blocks; a block holds BLOCK weights and their scale (fp16), and a min
 * where the type has one:
 *   Q8_0 (34 bytes): d, int8 q[32]                  w = d q
 *   Q4_0 (18 bytes): d, 16 bytes of 4-bit q         w = d (q - 8)
 *   Q4_1 (20 bytes): d, m, 16 bytes of 4-bit q      w = d q + m
 * a 4-bit block's byte j holding weight j in its low half and weight j + 16 in its high half.
 * Each block is dequantized in registers (BLOCK / LANES vectors of the CPU's width) and multiplied
 * into ROW_GROUP rows' accumulators, one vector per row and lane group, so a block read from memory
 * feeds several multiply-adds; sums are in float32. Written with gcc's vector extensions, built with
 * -march=native by model/cpu_kernels.py; used by model/block_quant.py. */
#include <stdint.h>
#include <string.h>

/* Sums in the order written (no reassociation, which -ffast-math allows): a row's output is then the
 * same whatever the other rows of its call (gcc would reorder each inlined row group differently). */
#pragma GCC optimize("no-associative-math")

#define BLOCK 32
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 }; /* ggml's type ids */

#if defined(__AVX512F__) /* 32 registers of 16 floats: 8 rows take 16 accumulators */
#define LANES 16
#define ROW_GROUP 8
#define OUT_GROUP 4 /* weight rows at once for 1 or 2 rows of 4-bit weights: 16 accumulators at 2 rows */
#elif defined(__AVX2__) /* 16 registers of 8 floats: 2 rows take 8 accumulators, a block 4 */
#define LANES 8
#define ROW_GROUP 2
#define OUT_GROUP 2
#else /* SSE, NEON: vectors of 4 floats */
#define LANES 4
#define ROW_GROUP 2
#define OUT_GROUP 2
#endif
#define PARTS (BLOCK / LANES)

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float unaligned_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));

/* The bytes one block of `type` takes (0 for a type this file does not read). */
static inline int64_t block_bytes(int64_t type) {
    switch (type) {
    case GGML_Q8_0: return 34;
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    default: return 0;
    }
}

static inline float half_to_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof(h));
    return (float)h;
}

/* Bytes to floats, LANES at a time: gcc's __builtin_convertvector from 8-bit lanes becomes a scalar
 * conversion per lane (gcc 12), so x86 widens through its intrinsics. The 4-bit nibbles come as
 * PARTS vectors of bytes (each weight's value in its own byte). */
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m128i lane_bytes; /* 16 bytes, one vector's worth */
static inline vec widen_signed(lane_bytes q) { return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
static inline vec widen_unsigned(lane_bytes q) { return (vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
static inline lane_bytes load_bytes(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline void nibbles_of(const uint8_t *p, lane_bytes *parts) { /* PARTS == 2 */
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    parts[0] = _mm_and_si128(v, low);
    parts[1] = _mm_and_si128(_mm_srli_epi16(v, 4), low);
}
#elif defined(__AVX2__)
#include <immintrin.h>
typedef __m128i lane_bytes; /* the low 8 bytes count */
static inline vec widen_signed(lane_bytes q) { return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
static inline vec widen_unsigned(lane_bytes q) { return (vec)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
static inline lane_bytes load_bytes(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
static inline void nibbles_of(const uint8_t *p, lane_bytes *parts) { /* PARTS == 4 */
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    const __m128i lows = _mm_and_si128(v, low), highs = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    parts[0] = lows, parts[1] = _mm_srli_si128(lows, 8), parts[2] = highs, parts[3] = _mm_srli_si128(highs, 8);
}
#else /* portable: a lane at a time */
typedef struct {
    uint8_t b[LANES];
} lane_bytes;
static inline vec widen_signed(lane_bytes q) {
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = (float)(int8_t)q.b[i];
    return v;
}
static inline vec widen_unsigned(lane_bytes q) {
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = (float)q.b[i];
    return v;
}
static inline lane_bytes load_bytes(const uint8_t *p) {
    lane_bytes q;
    memcpy(q.b, p, LANES);
    return q;
}
static inline void nibbles_of(const uint8_t *p, lane_bytes *parts) {
    for (int i = 0; i < BLOCK; i++) parts[i / LANES].b[i % LANES] = i < BLOCK / 2 ? p[i] & 15 : p[i - BLOCK / 2] >> 4;
}
#endif

/* The block's BLOCK weights as PARTS vectors. `type` is a constant where this is inlined. */
static inline __attribute__((always_inline)) void dequantize_block(int type, const uint8_t *block, vec *w) {
    const float d = half_to_float(block);
    if (type == GGML_Q8_0) {
        for (int j = 0; j < PARTS; j++) w[j] = widen_signed(load_bytes(block + 2 + j * LANES)) * d;
        return;
    }
    lane_bytes parts[PARTS];
    nibbles_of(block + (type == GGML_Q4_1 ? 4 : 2), parts);
    const float m = type == GGML_Q4_1 ? half_to_float(block + 2) : 0.0f;
    for (int j = 0; j < PARTS; j++) {
        const vec values = widen_unsigned(parts[j]);
        w[j] = type == GGML_Q4_1 ? values * d + m : (values - 8.0f) * d;
    }
}

/* The sum of a row's accumulators, halving the vector (an explicit tree: the same order in every copy). */
static inline __attribute__((always_inline)) float horizontal_sum(const vec *acc) {
    vec total = acc[0];
    for (int j = 1; j < PARTS; j++) total += acc[j];
    float lanes[LANES];
    memcpy(lanes, &total, sizeof(lanes));
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    return lanes[0];
}

/* y[r, o + q] = bias[o + q] + sum_k x[r, k] W[o + q, k] for R rows and O weight rows (constants where
 * inlined): O rows of weights at once give a few rows O independent chains of multiply-adds. Each
 * output's sums run in the same order whatever R and O. */
static inline __attribute__((always_inline)) void rows_dot(int R, int O, int type, const float *x, const uint8_t *w, const float *bias,
                                                           float *y, int64_t in, int64_t out, int64_t o) {
    const int64_t size = block_bytes(type), row_size = in / BLOCK * size;
    vec acc[ROW_GROUP][OUT_GROUP][PARTS];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < O; q++)
            for (int j = 0; j < PARTS; j++) acc[r][q][j] = (vec){0};
    for (int64_t b = 0; b < in / BLOCK; b++)
        for (int q = 0; q < O; q++) {
            vec weights[PARTS];
            dequantize_block(type, w + (o + q) * row_size + b * size, weights);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < PARTS; j++)
                    acc[r][q][j] += weights[j] * *(const unaligned_vec *)(x + r * in + b * BLOCK + j * LANES);
        }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < O; q++) {
            const float sum = horizontal_sum(acc[r][q]);
            y[r * out + o + q] = bias != NULL ? sum + bias[o + q] : sum;
        }
}

/* Every output of `type`'s weights for `rows` rows: one or two rows of 4-bit weights OUT_GROUP weight rows at a time,
 * more rows one weight row at a time in groups of up to ROW_GROUP rows (R, O made constants). */
static inline __attribute__((always_inline)) void typed_linear(int type, const float *x, const uint8_t *w, const float *bias, float *y,
                                                               int64_t rows, int64_t in, int64_t out) {
    int64_t o = 0;
    if (rows <= 2 && type != GGML_Q8_0) /* Q8_0 ran slower so (gcc 12, AMD EPYC: 3.6 ms where 2.0) */
        for (; o + OUT_GROUP <= out; o += OUT_GROUP) {
            if (rows == 2)
                rows_dot(2, OUT_GROUP, type, x, w, bias, y, in, out, o);
            else
                rows_dot(1, OUT_GROUP, type, x, w, bias, y, in, out, o);
        }
    for (; o < out; o++)
        for (int64_t r = 0; r < rows; r += ROW_GROUP) {
            const int64_t n = rows - r < ROW_GROUP ? rows - r : ROW_GROUP;
            const float *xr = x + r * in;
            float *yr = y + r * out;
            switch (n) {
#if ROW_GROUP >= 8
            case 8: rows_dot(8, 1, type, xr, w, bias, yr, in, out, o); break;
            case 7: rows_dot(7, 1, type, xr, w, bias, yr, in, out, o); break;
            case 6: rows_dot(6, 1, type, xr, w, bias, yr, in, out, o); break;
            case 5: rows_dot(5, 1, type, xr, w, bias, yr, in, out, o); break;
            case 4: rows_dot(4, 1, type, xr, w, bias, yr, in, out, o); break;
            case 3: rows_dot(3, 1, type, xr, w, bias, yr, in, out, o); break;
#endif
            case 2: rows_dot(2, 1, type, xr, w, bias, yr, in, out, o); break;
            default: rows_dot(1, 1, type, xr, w, bias, yr, in, out, o); break;
            }
        }
}

/* y (rows, out) = x (rows, in) W^T + bias (out, or NULL), W (out, in) in blocks of `type` (Q8_0,
 * Q4_0, Q4_1), in a multiple of BLOCK; all contiguous. Returns 0, or -1 for another type. */
int block_linear(const float *x, const uint8_t *w, const float *bias, float *y, int64_t rows, int64_t in, int64_t out, int64_t type) {
    switch (type) {
    case GGML_Q8_0: typed_linear(GGML_Q8_0, x, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_0: typed_linear(GGML_Q4_0, x, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_1: typed_linear(GGML_Q4_1, x, w, bias, y, rows, in, out); return 0;
    default: return -1;
    }
}

static inline __attribute__((always_inline)) void typed_rows(int type, const uint8_t *w, const int64_t *ids, int64_t n, int64_t in,
                                                             float *dst) {
    const int64_t size = block_bytes(type), row_size = in / BLOCK * size;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *w_row = w + (ids != NULL ? ids[i] : i) * row_size;
        for (int64_t b = 0; b < in / BLOCK; b++) {
            vec values[PARTS];
            dequantize_block(type, w_row + b * size, values);
            memcpy(dst + i * in + b * BLOCK, values, sizeof(values));
        }
    }
}

/* dst (n, in) float32 = the weight rows ids[0..n) (rows 0..n-1 where ids is NULL) of W in blocks of
 * `type`, dequantized as block_linear reads them. The caller checks the ids. Returns 0, or -1 for
 * another type. */
int block_rows(const uint8_t *w, const int64_t *ids, int64_t n, int64_t in, int64_t type, float *dst) {
    switch (type) {
    case GGML_Q8_0: typed_rows(GGML_Q8_0, w, ids, n, in, dst); return 0;
    case GGML_Q4_0: typed_rows(GGML_Q4_0, w, ids, n, in, dst); return 0;
    case GGML_Q4_1: typed_rows(GGML_Q4_1, w, ids, n, in, dst); return 0;
    default: return -1;
    }
}
