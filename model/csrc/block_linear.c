/* Linear layers whose weights stay in GGUF's quantized blocks, float32 activations: y = x W^T + b
 * for the few rows of a decode step, each weight row read once as it lies in the file. W (out, in)
 * is `out` rows of in / BLOCK blocks; a block holds BLOCK weights and their scale (fp16), and a min
 * where the type has one:
 *   Q8_0 (34 bytes): d, int8 q[32]                  w = d q
 *   Q4_0 (18 bytes): d, 16 bytes of 4-bit q         w = d (q - 8)
 *   Q4_1 (20 bytes): d, m, 16 bytes of 4-bit q      w = d q + m
 * a 4-bit block's byte j holding weight j in its low half and weight j + 16 in its high half; and
 * the k-quants, super-blocks of 256 weights in 8 blocks of 32 (16 of 16 for Q6_K) with 6- or 8-bit
 * scales of their own (llama.cpp's ggml-quants.c dequantize_row_q4_K, _q5_K, _q6_K):
 *   Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit scales and mins, 128 of 4-bit q    w = d sc q - dmin m
 *   Q5_K (176 bytes): the same, and 32 bytes of fifth bits                          w = d sc q - dmin m
 *   Q6_K (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d  w = d sc (q - 32)
 * Each block is dequantized in registers (BLOCK / LANES vectors of the CPU's width) and multiplied
 * into ROW_GROUP rows' accumulators, one vector per row and lane group, so a block read from memory
 * feeds several multiply-adds; sums are in float32. Written with gcc's vector extensions, built with
 * -march=native by model/cpu_kernels.py; used by model/block_quant.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Sums in the order written (no reassociation, which -ffast-math allows): a row's output is then the
 * same whatever the other rows of its call (gcc would reorder each inlined row group differently). */
#pragma GCC optimize("no-associative-math")

#define BLOCK 32
#define SUPER 256 /* weights in a k-quant's super-block */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 }; /* ggml's type ids */
enum { GGML_Q4_0_X8 = 102, GGML_Q4_1_X8 = 103, GGML_Q8_0_X8 = 108 }; /* ours: their blocks of 8 rows interleaved (below) */

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

/* The bytes one block (a k-quant: one super-block) of `type` takes (0 for a type this file does not read). */
static inline int64_t block_bytes(int64_t type) {
    switch (type) {
    case GGML_Q8_0: case GGML_Q8_0_X8: return 34;
    case GGML_Q4_0: case GGML_Q4_0_X8: return 18;
    case GGML_Q4_1: case GGML_Q4_1_X8: return 20;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

/* The file's type whose blocks an interleaved type holds (the type itself for the others). */
static inline int64_t file_type(int64_t type) {
    return type == GGML_Q8_0_X8 ? GGML_Q8_0 : type == GGML_Q4_0_X8 ? GGML_Q4_0 : type == GGML_Q4_1_X8 ? GGML_Q4_1 : type;
}

static inline int is_k_quant(int64_t type) { return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K; }

/* The bytes of one weight row of `in` (a multiple of the type's block) in blocks of `type`. */
static inline int64_t row_bytes_of(int64_t type, int64_t in) { return in / (is_k_quant(type) ? SUPER : BLOCK) * block_bytes(type); }

/* row_bytes_of for callers that check their arguments: -1 for a type this file does not read, or an
 * `in` below one block or not a multiple of the type's block. */
int64_t block_row_bytes(int64_t type, int64_t in) {
    const int64_t weights = is_k_quant(type) ? SUPER : BLOCK;
    return block_bytes(type) == 0 || in < weights || in % weights ? -1 : row_bytes_of(type, in);
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
#endif
#if defined(__AVX2__) /* and AVX-512 */
/* Each byte's bits (v >> shift) & mask, and a | b << 4 (b's bytes below 16). */
static inline lane_bytes byte_bits(lane_bytes v, int shift, int mask) { return _mm_and_si128(_mm_srli_epi16(v, shift), _mm_set1_epi8((char)mask)); }
static inline lane_bytes or_high(lane_bytes a, lane_bytes b) { return _mm_or_si128(a, _mm_slli_epi16(b, 4)); }
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
static inline lane_bytes byte_bits(lane_bytes v, int shift, int mask) {
    for (int i = 0; i < LANES; i++) v.b[i] = (uint8_t)((v.b[i] >> shift) & mask);
    return v;
}
static inline lane_bytes or_high(lane_bytes a, lane_bytes b) {
    for (int i = 0; i < LANES; i++) a.b[i] = (uint8_t)(a.b[i] | b.b[i] << 4);
    return a;
}
#endif

/* A k-quant's 6-bit scale and min of block j (0..7) from its 12 bytes (ggml's get_scale_min_k4). */
static inline void k_scale_min(int j, const uint8_t *q, float *scale, float *min) {
    if (j < 4) {
        *scale = (float)(q[j] & 63), *min = (float)(q[j + 4] & 63);
    } else {
        *scale = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *min = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Block b (BLOCK weights) of a weight row, as PARTS vectors. `type` is a constant where this is inlined. */
static inline __attribute__((always_inline)) void dequantize_block(int type, const uint8_t *row, int64_t b, vec *w) {
    if (is_k_quant(type)) {
        const uint8_t *super = row + b / 8 * block_bytes(type);
        const int j = (int)(b % 8); /* the block within its super-block */
        if (type == GGML_Q6_K) {
            const int n = j / 4, g = j % 4; /* the super-block's half, and which of its four 32-weight quarters */
            const uint8_t *low = super + 64 * n + 32 * (g & 1), *high = super + 128 + 32 * n;
            const int8_t *scales = (const int8_t *)(super + 192) + 8 * n + 2 * g;
            const float d = half_to_float(super + 208);
            for (int p = 0; p < PARTS; p++) {
                const lane_bytes q = or_high(byte_bits(load_bytes(low + p * LANES), 4 * (g >> 1), 15),
                                             byte_bits(load_bytes(high + p * LANES), 2 * g, 3));
                w[p] = (widen_unsigned(q) - 32.0f) * (d * (float)scales[p * LANES / 16]);
            }
            return;
        }
        float scale, min;
        k_scale_min(j, super + 4, &scale, &min);
        const float d = half_to_float(super) * scale, m = half_to_float(super + 2) * min;
        const uint8_t *nibbles = super + (type == GGML_Q5_K ? 48 : 16) + 32 * (j / 2);
        for (int p = 0; p < PARTS; p++) {
            lane_bytes q = byte_bits(load_bytes(nibbles + p * LANES), 4 * (j & 1), 15);
            if (type == GGML_Q5_K) q = or_high(q, byte_bits(load_bytes(super + 16 + p * LANES), j, 1));
            w[p] = widen_unsigned(q) * d - m;
        }
        return;
    }
    const uint8_t *block = row + b * block_bytes(type);
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
    const int64_t row_size = row_bytes_of(type, in);
    vec acc[ROW_GROUP][OUT_GROUP][PARTS];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < O; q++)
            for (int j = 0; j < PARTS; j++) acc[r][q][j] = (vec){0};
    for (int64_t b = 0; b < in / BLOCK; b++)
        for (int q = 0; q < O; q++) {
            vec weights[PARTS];
            dequantize_block(type, w + (o + q) * row_size, b, weights);
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
 * Q4_0, Q4_1; Q4_K, Q5_K, Q6_K), in a multiple of the type's block; all contiguous. Returns 0, or
 * -1 for another type. */
int block_linear(const float *x, const uint8_t *w, const float *bias, float *y, int64_t rows, int64_t in, int64_t out, int64_t type) {
    switch (type) {
    case GGML_Q8_0: typed_linear(GGML_Q8_0, x, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_0: typed_linear(GGML_Q4_0, x, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_1: typed_linear(GGML_Q4_1, x, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_K: typed_linear(GGML_Q4_K, x, w, bias, y, rows, in, out); return 0;
    case GGML_Q5_K: typed_linear(GGML_Q5_K, x, w, bias, y, rows, in, out); return 0;
    case GGML_Q6_K: typed_linear(GGML_Q6_K, x, w, bias, y, rows, in, out); return 0;
    default: return -1;
    }
}

static inline __attribute__((always_inline)) void typed_rows(int type, const uint8_t *w, const int64_t *ids, int64_t n, int64_t in,
                                                             float *dst) {
    const int64_t row_size = row_bytes_of(type, in);
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *w_row = w + (ids != NULL ? ids[i] : i) * row_size;
        for (int64_t b = 0; b < in / BLOCK; b++) {
            vec values[PARTS];
            dequantize_block(type, w_row, b, values);
            memcpy(dst + i * in + b * BLOCK, values, sizeof(values));
        }
    }
}

/* Row r's block, in the file's layout (block_bytes(type) bytes into dst), of an interleaved group's
 * block (the layout below, at 8-bit activations' kernels): its scale, Q4_1's min, its weights'
 * granules of 4 bytes (granule g of row r at (g 8 + r) 4). */
static inline __attribute__((always_inline)) void file_block(int type, const uint8_t *group_block, int64_t r, uint8_t *dst) {
    const int granules = type == GGML_Q8_0 ? 8 : 4, head = type == GGML_Q4_1 ? 4 : 2;
    memcpy(dst, group_block + 4 * 8 * granules + 2 * r, 2);
    if (type == GGML_Q4_1) memcpy(dst + 2, group_block + 4 * 8 * granules + 16 + 2 * r, 2);
    for (int g = 0; g < granules; g++) memcpy(dst + head + 4 * g, group_block + (g * 8 + r) * 4, 4);
}

/* typed_rows for the interleaved types (of `type`'s blocks): a row's blocks put back as the file's, then dequantized. */
static inline __attribute__((always_inline)) void interleaved_rows(int type, const uint8_t *w, const int64_t *ids, int64_t n, int64_t in,
                                                                   float *dst) {
    const int64_t size = block_bytes(type), group_size = 8 * row_bytes_of(type, in);
    uint8_t block[34]; /* the largest of the three */
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = ids != NULL ? ids[i] : i;
        const uint8_t *group = w + row / 8 * group_size;
        for (int64_t b = 0; b < in / BLOCK; b++) {
            vec values[PARTS];
            file_block(type, group + b * 8 * size, row % 8, block);
            dequantize_block(type, block, 0, values);
            memcpy(dst + i * in + b * BLOCK, values, sizeof(values));
        }
    }
}

/* dst (n, in) float32 = the weight rows ids[0..n) (rows 0..n-1 where ids is NULL) of W in blocks of
 * `type`, dequantized as block_linear reads them (an interleaved type: W from a group's first row).
 * The caller checks the ids. Returns 0, or -1 for another type. */
int block_rows(const uint8_t *w, const int64_t *ids, int64_t n, int64_t in, int64_t type, float *dst) {
    switch (type) {
    case GGML_Q8_0: typed_rows(GGML_Q8_0, w, ids, n, in, dst); return 0;
    case GGML_Q4_0: typed_rows(GGML_Q4_0, w, ids, n, in, dst); return 0;
    case GGML_Q4_1: typed_rows(GGML_Q4_1, w, ids, n, in, dst); return 0;
    case GGML_Q4_K: typed_rows(GGML_Q4_K, w, ids, n, in, dst); return 0;
    case GGML_Q5_K: typed_rows(GGML_Q5_K, w, ids, n, in, dst); return 0;
    case GGML_Q6_K: typed_rows(GGML_Q6_K, w, ids, n, in, dst); return 0;
    case GGML_Q8_0_X8: interleaved_rows(GGML_Q8_0, w, ids, n, in, dst); return 0;
    case GGML_Q4_0_X8: interleaved_rows(GGML_Q4_0, w, ids, n, in, dst); return 0;
    case GGML_Q4_1_X8: interleaved_rows(GGML_Q4_1, w, ids, n, in, dst); return 0;
    default: return -1;
    }
}

/* ---- 8-bit activations (llama.cpp's way): each row quantized to int8 in blocks of 32 with a float
 * scale (Q8_0's rounding), so that a block's products are integer dot products: AVX-512 VNNI's
 * vpdpbusd (on 256-bit vectors), else AVX2's vpmaddubsw and vpmaddwd. A weight block and an
 * activation block give d_w d_x sum(q_w q_x) (+ m_w d_x sum(q_x) for Q4_1). x86 with AVX2 only;
 * block_linear_q8_available() says whether this build has them. */
#if defined(__AVX2__)
#define Q8_ROW_GROUP 4

/* 32 weights of a block as bytes: Q8_0 and Q4_0 (q - 8) signed, Q4_1 unsigned (0..15). */
static inline __attribute__((always_inline)) __m256i block_bytes_of(int type, const uint8_t *block) {
    if (type == GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)(block + 2));
    const __m128i v = _mm_loadu_si128((const __m128i *)(block + (type == GGML_Q4_1 ? 4 : 2))), low = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    return type == GGML_Q4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
}

/* 8 int32 sums of 4 products each of unsigned u and signed s bytes (|u s| sums of two fit int16 here). */
static inline __m256i dot_bytes(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float sum8(__m256 v) { /* a fixed order: halves, then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Q4_1's sum over a row's blocks of m_w xs. Not inlined: one order of operations for every row group. */
static __attribute__((noinline)) float min_terms(const uint8_t *w_row, const float *xs, int64_t blocks) {
    float sum = 0.0f;
    for (int64_t b = 0; b < blocks; b++) sum += half_to_float(w_row + b * 20 + 2) * xs[b]; /* a Q4_1 block: d, then m */
    return sum;
}

/* R rows' (R a constant where inlined) outputs o of W: x's blocks xq (int8), their scales xd and
 * xd * sum(xq) (xs, Q4_1's min term). Two accumulators a row, even and odd blocks, in that order. */
static inline __attribute__((always_inline)) void q8_rows_dot(int R, int type, const int8_t *xq, const float *xd, const float *xs,
                                                              const uint8_t *w_row, const float *bias, float *y, int64_t in,
                                                              int64_t out, int64_t o) {
    const int64_t size = block_bytes(type), blocks = in / BLOCK;
    __m256 acc[Q8_ROW_GROUP][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w_row + b * size;
        const __m256i q = block_bytes_of(type, block);
        const __m256i u = type == GGML_Q4_1 ? q : _mm256_sign_epi8(q, q); /* |q| */
        const float d = half_to_float(block);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * in + b * BLOCK));
            const __m256i sums = dot_bytes(u, type == GGML_Q4_1 ? x : _mm256_sign_epi8(x, q));
            acc[r][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * xd[r * blocks + b]), acc[r][b & 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        const float mins = type == GGML_Q4_1 ? min_terms(w_row, xs + r * blocks, blocks) : 0.0f;
        const float sum = sum8(_mm256_add_ps(acc[r][0], acc[r][1])) + mins;
        y[r * out + o] = bias != NULL ? sum + bias[o] : sum;
    }
}

static inline __attribute__((always_inline)) void q8_typed_linear(int type, const int8_t *xq, const float *xd, const float *xs,
                                                                  const uint8_t *w, const float *bias, float *y, int64_t rows,
                                                                  int64_t in, int64_t out) {
    const int64_t row_size = in / BLOCK * block_bytes(type), blocks = in / BLOCK;
    for (int64_t o = 0; o < out; o++)
        for (int64_t r = 0; r < rows; r += Q8_ROW_GROUP) {
            const int64_t n = rows - r < Q8_ROW_GROUP ? rows - r : Q8_ROW_GROUP;
            const int8_t *xr = xq + r * in;
            const float *dr = xd + r * blocks, *sr = xs + r * blocks;
            float *yr = y + r * out;
            switch (n) {
            case 4: q8_rows_dot(4, type, xr, dr, sr, w + o * row_size, bias, yr, in, out, o); break;
            case 3: q8_rows_dot(3, type, xr, dr, sr, w + o * row_size, bias, yr, in, out, o); break;
            case 2: q8_rows_dot(2, type, xr, dr, sr, w + o * row_size, bias, yr, in, out, o); break;
            default: q8_rows_dot(1, type, xr, dr, sr, w + o * row_size, bias, yr, in, out, o); break;
            }
        }
}
#endif

/* Int8 weights with one scale per output channel, as CTranslate2's (model/quantize.py Int8Linear):
 * y (rows, out) = (xq w^T) (xscale[r] wscale[o]) + bias, x (rows, in) float32 quantized here to xq
 * int8 with a scale per row (quantize_row_int8), in a multiple of BLOCK, weights in [-127, 127]. The weights interleaved in groups of 8 output rows
 * (the last group padded with zero rows), as the Q8_0_X8 blocks below lay out theirs but without
 * block scales: group G's block b is 8 granules g of 8 rows' 4 bytes, w_x8[G][b][g][l][j] =
 * w[8G + l][32b + 4g + j] (model/quantize.py interleave_int8). One vector of 8 int32 lanes holds 8
 * outputs' sums: each weight vector is read once for INT8_ROWS rows, against each row's 4 activation
 * bytes broadcast, with no horizontal sum; the sums are exact, so this computes what torch._int_mm's
 * path computes, then the scales as the GEMM path applies them. */
#if defined(__AVX2__)
#define INT8_ROWS 8 /* 8 accumulators beside the weight vector and its temporaries: 16 registers */

/* acc + 8 int32 sums of 4 products each of unsigned u and signed s bytes. */
static inline __m256i dot_bytes_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Outputs o..o+7 (group `group`'s rows, those below `out`) for R rows (a constant where inlined). */
static inline __attribute__((always_inline)) void int8_group(int R, const int8_t *xq, const float *xscale, const int8_t *group,
                                                             const float *wscale, const float *bias, float *y, int64_t in,
                                                             int64_t out, int64_t o) {
    __m256i acc[INT8_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4 /* 1.19-1.7x over one granule a loop at 1 to 128 rows (the AMD EPYC, AVX2) */
    for (int64_t k = 0; k < in; k += 4) { /* a granule: 4 weights of each of the 8 rows */
        const __m256i w = _mm256_loadu_si256((const __m256i *)(group + 8 * k)), u = _mm256_sign_epi8(w, w); /* |w| */
        for (int r = 0; r < R; r++) {
            int32_t x;
            memcpy(&x, xq + r * in + k, sizeof(x));
            acc[r] = dot_bytes_add(acc[r], u, _mm256_sign_epi8(_mm256_set1_epi32(x), w)); /* |w| against x signed as w */
        }
    }
    const int64_t n = out - o < 8 ? out - o : 8;
    for (int r = 0; r < R; r++) {
        int32_t sums[8];
        _mm256_storeu_si256((__m256i *)sums, acc[r]);
        for (int64_t j = 0; j < n; j++) {
            float sum = (float)sums[j] * (xscale[r] * wscale[o + j]); /* exact int32 sum, then the scales */
            __asm__("" : "+x"(sum)); /* rounded before the bias, as the GEMM path rounds it: no fused multiply-add */
            y[r * out + o + j] = bias != NULL ? sum + bias[o + j] : sum;
        }
    }
}
#endif

/* x (in floats) to q (int8) and its scale, as model/quantize.py's _quantized_rows computes them:
 * scale = max(max |x|, 1e-12) / 127, q = x / scale rounded to nearest, ties to even. True divisions
 * (no reciprocal, which -ffast-math would allow), so both paths hold the same bytes. A row holding
 * a NaN or an infinity (seen on the bits: -ffast-math assumes there are none) gets a NaN scale and
 * zeros, so its outputs are NaN, as the GEMM path's are. */
#if defined(__AVX2__)
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math")
static void quantize_row_int8(const float *x, int64_t in, int8_t *q, float *scale) {
    float amax = 0.0f;
    uint32_t special = 0;
    for (int64_t k = 0; k < in; k++) {
        uint32_t bits;
        memcpy(&bits, x + k, sizeof(bits));
        special |= (bits & 0x7f800000u) == 0x7f800000u;
        const float a = __builtin_fabsf(x[k]);
        amax = a > amax ? a : amax;
    }
    if (special) {
        const uint32_t nan_bits = 0x7fc00000u;
        memcpy(scale, &nan_bits, sizeof(*scale));
        memset(q, 0, (size_t)in);
        return;
    }
    const float d = (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
    *scale = d;
    for (int64_t k = 0; k < in; k++) q[k] = (int8_t)__builtin_rintf(x[k] / d);
}
#pragma GCC pop_options
#endif

/* The int8 product above, w_x8 in groups of 8 rows (out rounded up to a multiple of 8). Returns 0,
 * -1 where this build has no such kernel or in is not a multiple of BLOCK, -2 where memory ran out. */
int int8_linear(const float *x, const int8_t *w_x8, const float *wscale, const float *bias, float *y, int64_t rows, int64_t in, int64_t out) {
#if defined(__AVX2__)
    if (in % BLOCK) return -1;
    int8_t *xq = malloc((size_t)(rows * in));
    float *xscale = malloc((size_t)rows * sizeof(float));
    if (xq == NULL || xscale == NULL) {
        free(xq), free(xscale);
        return -2;
    }
    for (int64_t r = 0; r < rows; r++) quantize_row_int8(x + r * in, in, xq + r * in, xscale + r);
    for (int64_t o = 0; o < out; o += 8) {
        const int8_t *group = w_x8 + o * in;
        for (int64_t r = 0; r < rows; r += INT8_ROWS) {
            const int64_t n = rows - r < INT8_ROWS ? rows - r : INT8_ROWS;
            const int8_t *xr = xq + r * in;
            float *yr = y + r * out;
            switch (n) {
            case 8: int8_group(8, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            case 7: int8_group(7, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            case 6: int8_group(6, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            case 5: int8_group(5, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            case 4: int8_group(4, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            case 3: int8_group(3, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            case 2: int8_group(2, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            default: int8_group(1, xr, xscale + r, group, wscale, bias, yr, in, out, o); break;
            }
        }
    }
    free(xq), free(xscale);
    return 0;
#else
    (void)x, (void)w_x8, (void)wscale, (void)bias, (void)y, (void)rows, (void)in, (void)out;
    return -1;
#endif
}

/* x (rows, in) float32 -> xq (rows, in) int8 in blocks of BLOCK with scales xd (rows, in / BLOCK)
 * = max |x| / 127 (Q8_0's: values rounded to nearest, half away from zero, by the float32 scale;
 * the scale then kept in fp16, as llama.cpp's quantize_row_q8_0_ref) and, per block, xs = xd *
 * sum(xq); for weights of a Q4_1 type (llama.cpp's block_q8_1 s, quantize_row_q8_1_ref) the
 * float32 scale times sum(xq), kept in fp16. type: the weights' ggml type, which block_linear_q8 takes. */
void quantize_rows_q8(const float *x, int64_t rows, int64_t in, int8_t *xq, float *xd, float *xs, int64_t type) {
    const int q8_1 = type == GGML_Q4_1 || type == GGML_Q4_1_X8;
    for (int64_t i = 0; i < rows * in / BLOCK; i++) {
        const float *v = x + i * BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) amax = v[j] > amax ? v[j] : -v[j] > amax ? -v[j] : amax;
        const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            const int q = (int)__builtin_roundf(v[j] * inverse);
            xq[i * BLOCK + j] = (int8_t)q;
            sum += q;
        }
        const float stored = (float)(_Float16)d; /* kept as fp16, as llama.cpp's block_q8_0 keeps it */
        xd[i] = stored;
        xs[i] = q8_1 ? (float)(_Float16)(d * (float)sum) : stored * (float)sum;
    }
}

/* ---- Weights of 8 rows interleaved (the layout model/block_quant.py's interleave writes for the
 * types GGML_Q8_0_X8, GGML_Q4_0_X8 and GGML_Q4_1_X8: the file's bytes, placed for these kernels).
 * Each group of 8 weight rows keeps its blocks in order; block b of a group is its 8 rows' weights,
 * then their 8 fp16 scales d, then (Q4_1) their 8 fp16 mins m. The weights: Q8_0's 32 bytes a row
 * as (4 vectors, 2 halves, 8 rows, 4 bytes) where the file has (row, 8 granules of 4 bytes); the
 * 4-bit types' 16 bytes of nibbles a row as (2 vectors, 2 halves, 8 rows, 4 bytes) where the file
 * has (row, 4 granules), each vector's low and high nibbles then two vectors of weights. Either way,
 * 4 vectors whose 32-bit lane l holds 4 weights of row l % 8, and vpdpbusd sums them against the
 * activation block's matching 4 bytes: 8 rows' dot products at once, in lanes, with no horizontal
 * sum. AVX-512 with VNNI, or AVX2 (each 32 bytes of a block, one vector: 8 rows' 4 weights in its
 * 8 lanes, against one broadcast activation dword): block_linear_x8_available. Both compute each
 * row's integer sums exactly and then the same float operations, so they give the same outputs. */
#define GROUP_ROWS 8
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define X8_AVAILABLE 1
#define X8_ROWS 8 /* activation rows a group's weights are read for at once */

/* The activation dwords (4 bytes of a block) each weight vector's lanes 0-7 and 8-15 meet: Q8_0's
 * vector k holds granules 2k and 2k + 1; a 4-bit type's holds weights 0-3 and 4-7 (A's low nibbles),
 * 16-19 and 20-23 (A's high), 8-11 and 12-15 (B's low), 24-27 and 28-31 (B's high). */
static inline __m512i dword_pair(int first) {
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_add_epi32(lanes, _mm512_set1_epi32(first));
}

/* The block's 8 rows' exact integer dot products with one activation block xb (32 int8), as 8
 * int32 lanes (row 0 first). Q8_0's weights are signed: xb + 128 (unsigned) against them, less
 * 128 times each row's weight sum (wsum); the 4-bit types' are unsigned 0..15, against xb. */
static inline __attribute__((always_inline)) __m256i group_dots(int type, const __m512i *v, __m256i wsum, const int8_t *xb) {
    __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xb));
    const int q8 = type == GGML_Q8_0;
    __m512i sums = _mm512_setzero_si512();
    if (q8) x = _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80)); /* x + 128 as unsigned bytes */
    for (int k = 0; k < 4; k++) {
        const __m512i xk = _mm512_permutexvar_epi32(dword_pair(q8 ? 2 * k : (const int[]){0, 4, 2, 6}[k]), x);
        sums = q8 ? _mm512_dpbusd_epi32(sums, xk, v[k]) : _mm512_dpbusd_epi32(sums, v[k], xk);
    }
    const __m256i dots = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
    return q8 ? _mm256_sub_epi32(dots, _mm256_slli_epi32(wsum, 7)) : dots;
}

/* Outputs o..o+7 (group g's rows) for R rows (a constant where inlined) of 8-bit activations xq with
 * scales xd and xs = xd sum(xq) per block: y = sum_b d xd dot_b (+ sum_b m xs_b: Q4_1's m, Q4_0's
 * -8 d), each row's sums in block order whatever R. */
static inline __attribute__((always_inline)) void x8_group(int R, int type, const int8_t *xq, const float *xd, const float *xs,
                                                           const uint8_t *group, const float *bias, float *y, int64_t in,
                                                           int64_t out, int64_t o) {
    const int64_t blocks = in / BLOCK, size = GROUP_ROWS * block_bytes(type), weights = type == GGML_Q8_0 ? 256 : 128;
    const __m512i low = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
    __m256 acc[X8_ROWS], mins[X8_ROWS];
    for (int r = 0; r < R; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * size;
        __m512i v[4];
        __m256i wsum = _mm256_setzero_si256();
        if (type == GGML_Q8_0) {
            __m512i sums = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                v[k] = _mm512_loadu_si512(block + 64 * k);
                sums = _mm512_dpbusd_epi32(sums, ones, v[k]);
            }
            wsum = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
        } else {
            const __m512i a = _mm512_loadu_si512(block), c = _mm512_loadu_si512(block + 64);
            v[0] = _mm512_and_si512(a, low), v[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), low);
            v[2] = _mm512_and_si512(c, low), v[3] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + weights)));
        const __m256 m = type == GGML_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + weights + 16)))
                                           : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        for (int r = 0; r < R; r++) {
            const __m256 dots = _mm256_cvtepi32_ps(group_dots(type, v, wsum, xq + r * in + b * BLOCK));
            acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_set1_ps(xd[r * blocks + b])), acc[r]);
            if (type != GGML_Q8_0) mins[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * blocks + b]), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 sum = _mm256_add_ps(acc[r], mins[r]);
        if (bias != NULL) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + o));
        _mm256_storeu_ps(y + r * out + o, sum);
    }
}

#elif defined(__AVX2__)
#define X8_AVAILABLE 1
#define X8_ROWS 4 /* 16 vector registers: 4 rows' sums, accumulators and mins */

/* The 4 activation bytes at p, in every 32-bit lane. */
static inline __m256i broadcast_dword(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof(v));
    return _mm256_set1_epi32(v);
}

/* 8 int32 lanes: lane l the sum of its 4 products of unsigned u and signed s bytes (|u s| pair sums
 * fit int16 for the weights here: Q8_0's |w| <= 128 against |x| <= 127, nibbles <= 15). */
static inline __m256i lane_dots(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

/* The block's 8 rows' exact integer dot products with R activation blocks (xq + r in + b BLOCK) into
 * dots[r]: Q8_0's signed weights by |w| against x signed as w (x with w's sign), the 4-bit types'
 * unsigned nibbles against x. */
static inline __attribute__((always_inline)) void x8_block_dots(int R, int type, const uint8_t *block, const int8_t *xb, int64_t in,
                                                                __m256i *dots) {
    for (int r = 0; r < R; r++) dots[r] = _mm256_setzero_si256();
    if (type == GGML_Q8_0) {
        for (int g = 0; g < 8; g++) { /* granule g: weights 4g..4g+3 of the 8 rows */
            const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 32 * g)), u = _mm256_sign_epi8(w, w);
            for (int r = 0; r < R; r++)
                dots[r] = _mm256_add_epi32(dots[r], lane_dots(u, _mm256_sign_epi8(broadcast_dword(xb + r * in + 4 * g), w)));
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) { /* nibble bytes 4j..4j+3: weights 4j.. (low) and 16 + 4j.. (high) */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xb + r * in;
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast_dword(x + 4 * j)),
                                                   _mm256_maddubs_epi16(hi, broadcast_dword(x + 16 + 4 * j)));
            dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        }
    }
}

/* x8_group as the AVX-512 kernel's (its contract), for R <= X8_ROWS rows. */
static inline __attribute__((always_inline)) void x8_group(int R, int type, const int8_t *xq, const float *xd, const float *xs,
                                                           const uint8_t *group, const float *bias, float *y, int64_t in,
                                                           int64_t out, int64_t o) {
    const int64_t blocks = in / BLOCK, size = GROUP_ROWS * block_bytes(type), weights = type == GGML_Q8_0 ? 256 : 128;
    __m256 acc[X8_ROWS], mins[X8_ROWS];
    __m256i dots[X8_ROWS];
    for (int r = 0; r < R; r++) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * size;
        x8_block_dots(R, type, block, xq + b * BLOCK, in, dots);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + weights)));
        const __m256 m = type == GGML_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + weights + 16)))
                                           : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * blocks + b])), acc[r]);
            if (type != GGML_Q8_0) mins[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * blocks + b]), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 sum = _mm256_add_ps(acc[r], mins[r]);
        if (bias != NULL) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + o));
        _mm256_storeu_ps(y + r * out + o, sum);
    }
}
#else
#define X8_AVAILABLE 0
#endif

#if X8_AVAILABLE
static inline __attribute__((always_inline)) void x8_typed_linear(int type, const int8_t *xq, const float *xd, const float *xs,
                                                                  const uint8_t *w, const float *bias, float *y, int64_t rows,
                                                                  int64_t in, int64_t out) {
    const int64_t group_size = GROUP_ROWS * row_bytes_of(type, in), blocks = in / BLOCK;
    for (int64_t o = 0; o < out; o += GROUP_ROWS)
        for (int64_t r = 0; r < rows; r += X8_ROWS) {
            const int64_t n = rows - r < X8_ROWS ? rows - r : X8_ROWS;
            const int8_t *xr = xq + r * in;
            const float *dr = xd + r * blocks, *sr = xs + r * blocks;
            const uint8_t *g = w + o / GROUP_ROWS * group_size;
            float *yr = y + r * out;
            switch (n) {
#if X8_ROWS == 8
            case 8: x8_group(8, type, xr, dr, sr, g, bias, yr, in, out, o); break;
            case 7: x8_group(7, type, xr, dr, sr, g, bias, yr, in, out, o); break;
            case 6: x8_group(6, type, xr, dr, sr, g, bias, yr, in, out, o); break;
            case 5: x8_group(5, type, xr, dr, sr, g, bias, yr, in, out, o); break;
#endif
            case 4: x8_group(4, type, xr, dr, sr, g, bias, yr, in, out, o); break;
            case 3: x8_group(3, type, xr, dr, sr, g, bias, yr, in, out, o); break;
            case 2: x8_group(2, type, xr, dr, sr, g, bias, yr, in, out, o); break;
            default: x8_group(1, type, xr, dr, sr, g, bias, yr, in, out, o); break;
            }
        }
}
#endif

/* The weight rows an interleaved type's group holds (8), 1 for the file's types. */
int block_group_rows(int64_t type) { return file_type(type) != type ? 8 : 1; }

/* Whether the interleaved types' kernels are built here (AVX2, or AVX-512 with VNNI). */
int block_linear_x8_available(void) { return X8_AVAILABLE; }

/* block_linear_q8 for W (out, a multiple of 8) of an interleaved type. Returns 0, or -1 for another
 * type or where this build has no such kernel. */
static int block_linear_x8(const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *bias, float *y,
                           int64_t rows, int64_t in, int64_t out, int64_t type) {
#if X8_AVAILABLE
    switch (type) {
    case GGML_Q8_0_X8: x8_typed_linear(GGML_Q8_0, xq, xd, xs, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_0_X8: x8_typed_linear(GGML_Q4_0, xq, xd, xs, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_1_X8: x8_typed_linear(GGML_Q4_1, xq, xd, xs, w, bias, y, rows, in, out); return 0;
    default: return -1;
    }
#else
    (void)xq, (void)xd, (void)xs, (void)w, (void)bias, (void)y, (void)rows, (void)in, (void)out, (void)type;
    return -1;
#endif
}

/* Whether block_linear_q8 is built here (x86 with AVX2). */
int block_linear_q8_available(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* Whether block_linear_q8 multiplies weights of `type` in this build. */
int block_linear_q8_reads(int64_t type) {
    if (file_type(type) != type) return block_linear_x8_available();
    return block_linear_q8_available() && (type == GGML_Q8_0 || type == GGML_Q4_0 || type == GGML_Q4_1);
}

/* block_linear with x given as quantize_rows_q8's xq, xd, xs (rows of in): y (rows, out) = x W^T +
 * bias, W of Q8_0, Q4_0, Q4_1 or their interleaved types (out a multiple of 8). Returns 0, or -1 for
 * another type or where this build has no such kernel. */
int block_linear_q8(const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *bias, float *y, int64_t rows,
                    int64_t in, int64_t out, int64_t type) {
#if defined(__AVX2__)
    switch (type) {
    case GGML_Q8_0: q8_typed_linear(GGML_Q8_0, xq, xd, xs, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_0: q8_typed_linear(GGML_Q4_0, xq, xd, xs, w, bias, y, rows, in, out); return 0;
    case GGML_Q4_1: q8_typed_linear(GGML_Q4_1, xq, xd, xs, w, bias, y, rows, in, out); return 0;
    default: return block_linear_x8(xq, xd, xs, w, bias, y, rows, in, out, type);
    }
#else
    (void)xq, (void)xd, (void)xs, (void)w, (void)bias, (void)y, (void)rows, (void)in, (void)out, (void)type;
    return -1;
#endif
}
