/* The CPU kernels of the operators torch.ops.transformer_serving.panel_linear,
 * paged_decode_attention, block_linear and int8_linear, in C++: a call, from a compiled graph or
 * eagerly, goes from torch's dispatcher to the C kernel (panel_linear.c, paged_attention.c,
 * block_linear.c) without Python: 1.4-2 us a call more than the C kernel alone, where their Python
 * functions (model/packed_linear.py, model/paged_attention_cpu.py, model/block_quant.py,
 * model/quantize.py) cost 6-7 us more (a compiled decode step of the shipped generator makes 31
 * calls: docs/performance.md), block_product, which also quantizes the rows, 15-20 us more. The
 * operators' schemas are defined in Python (model/cpu_kernels.py: register_operator), from those
 * functions, which these kernels equal. Built and loaded by model/cpu_kernels.py, linked against
 * the C kernels' library. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

extern "C" {
void panel_linear(const float *x, const float *panels, const float *bias, float *y, int64_t rows, int64_t in, int64_t out);
int64_t panel_linear_max_rows(void);
int paged_decode_attention(const float *q, const float *keys, const float *values, const int64_t *block_tables, int64_t table_stride,
                           const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                           int64_t num_blocks, float scale);
int64_t block_row_bytes(int64_t type, int64_t in);
int block_linear(const float *x, const uint8_t *w, const float *bias, float *y, int64_t rows, int64_t in, int64_t out, int64_t type);
int block_rows(const uint8_t *w, const int64_t *ids, int64_t n, int64_t in, int64_t type, float *dst);
int block_linear_q8_reads(int64_t type);
int block_group_rows(int64_t type);
void quantize_rows_q8(const float *x, int64_t rows, int64_t in, int8_t *xq, float *xd, float *xs, int64_t type);
int block_linear_q8(const int8_t *xq, const float *xd, const float *xs, const uint8_t *w, const float *bias, float *y, int64_t rows,
                    int64_t in, int64_t out, int64_t type);
int int8_linear(const float *x, const int8_t *w_x8, const float *wscale, const float *bias, float *y, int64_t rows, int64_t in, int64_t out);
}

namespace {

/* y (N, out_features) = rows (N, in) W^T + bias, W in panels (P, in, PANEL): panel_product's contract. */
at::Tensor panel_linear_kernel(const at::Tensor &input, const at::Tensor &panels, const std::optional<at::Tensor> &bias,
                               int64_t out_features) {
    TORCH_CHECK_VALUE(input.dim() == 2 && input.scalar_type() == at::kFloat, "panel_linear: rows (N, in) float32");
    TORCH_CHECK_VALUE(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat && panels.size(1) == input.size(1) &&
                          panels.size(2) == 32 && out_features >= 1 && panels.size(0) * 32 >= out_features,
                      "panel_linear: panels (P, in, 32) contiguous float32, P * 32 >= out_features >= 1");
    TORCH_CHECK_VALUE(!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == out_features),
                      "panel_linear: bias (out_features,) contiguous float32");
    const at::Tensor rows = input.contiguous();
    const int64_t n = rows.size(0), in = rows.size(1), piece = panel_linear_max_rows();
    at::Tensor y = at::empty({n, out_features}, rows.options());
    const float *x = rows.const_data_ptr<float>(), *b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
    float *out = y.mutable_data_ptr<float>();
    for (int64_t first = 0; first < n; first += piece) /* more rows than a call takes: in pieces, in place */
        panel_linear(x + first * in, panels.const_data_ptr<float>(), b, out + first * out_features, std::min(piece, n - first), in,
                     out_features);
    return y;
}

/* Attention (B, H, D) of queries (B, H, D) over each row's keys in the pools: _kernel_attention's contract. */
at::Tensor paged_decode_attention_kernel(const at::Tensor &input, const at::Tensor &keys, const at::Tensor &values,
                                         const at::Tensor &key_blocks, const at::Tensor &key_lengths) {
    TORCH_CHECK_VALUE(input.dim() == 3 && input.scalar_type() == at::kFloat, "paged_decode_attention: queries (B, H, D) float32");
    TORCH_CHECK_VALUE(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == at::kFloat &&
                          values.scalar_type() == at::kFloat && values.sizes() == keys.sizes(),
                      "paged_decode_attention: pools (num_blocks, block_size, Hkv, D) contiguous float32");
    const at::Tensor queries = input.contiguous();
    const at::Tensor blocks = key_blocks.to(at::kLong).contiguous(), lengths = key_lengths.to(at::kLong).contiguous();
    const int64_t B = queries.size(0), H = queries.size(1), D = queries.size(2), block_size = keys.size(1), Hkv = keys.size(2);
    TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0 && keys.size(3) == D, "paged_decode_attention: query heads a multiple of key heads, one head size");
    TORCH_CHECK_VALUE(blocks.dim() == 2 && blocks.size(0) == B && lengths.dim() == 1 && lengths.size(0) == B,
                      "paged_decode_attention: block tables (B, nb) and lengths (B,) for the B queries");
    at::Tensor out = at::empty({B, H, D}, queries.options());
    const int status = paged_decode_attention(queries.const_data_ptr<float>(), keys.const_data_ptr<float>(), values.const_data_ptr<float>(),
                                              blocks.const_data_ptr<int64_t>(), blocks.size(1), lengths.const_data_ptr<int64_t>(),
                                              out.mutable_data_ptr<float>(), B, H, Hkv, D, block_size, keys.size(0),
                                              static_cast<float>(std::pow(double(D), -0.5)));
    TORCH_CHECK_VALUE(status != -2, "paged_decode_attention: lengths past the rows' ", blocks.size(1), " blocks of ", block_size);
    TORCH_CHECK_VALUE(status != -3, "paged_decode_attention: a length below 1");
    TORCH_CHECK_VALUE(status != -4, "paged_decode_attention: a block id outside the pools' ", keys.size(0), " blocks");
    TORCH_CHECK(status == 0, "paged_decode_attention: out of memory for its scores");
    return out;
}

constexpr int64_t SLAB_FLOATS = 1 << 18; /* model/block_quant.py's: the weights a slab dequantizes at once */

/* y (N, out_features) = rows (N, in) W^T + bias, W (out_features, row bytes) in blocks of ggml_type:
 * block_product's contract (model/block_quant.py), which this equals to the bit. */
at::Tensor block_linear_kernel(const at::Tensor &input, const at::Tensor &blocks, const std::optional<at::Tensor> &bias,
                               int64_t out_features, int64_t ggml_type, int64_t activation_bits, int64_t kernel_rows) {
    TORCH_CHECK_VALUE(input.dim() == 2 && input.scalar_type() == at::kFloat, "block_linear: rows (N, in) float32");
    const int64_t in = input.size(1), row_size = block_row_bytes(ggml_type, in);
    TORCH_CHECK_VALUE(row_size > 0, "block_linear: ", in, " input features in blocks of GGML type ", ggml_type,
                      ": a type the kernels do not read, or not a multiple of its block");
    TORCH_CHECK_VALUE(blocks.dim() == 2 && blocks.is_contiguous() && blocks.scalar_type() == at::kByte && blocks.size(0) == out_features &&
                          blocks.size(1) == row_size,
                      "block_linear: blocks (out_features, ", row_size, " bytes a row) contiguous uint8");
    const int64_t group = block_group_rows(ggml_type);
    TORCH_CHECK_VALUE(out_features % group == 0, "block_linear: ", out_features, " outputs in groups of ", group, " rows");
    TORCH_CHECK_VALUE(!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == out_features),
                      "block_linear: bias (out_features,) contiguous float32");
    const at::Tensor rows = input.contiguous();
    const int64_t n = rows.size(0);
    const uint8_t *w = blocks.const_data_ptr<uint8_t>();
    const float *x = rows.const_data_ptr<float>(), *b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
    if (activation_bits == 8 && block_linear_q8_reads(ggml_type)) { /* every row by integer dot products */
        at::Tensor quantized = at::empty({n, in}, rows.options().dtype(at::kChar)), scales = at::empty({2, n, in / 32}, rows.options());
        float *d = scales.mutable_data_ptr<float>();
        quantize_rows_q8(x, n, in, quantized.mutable_data_ptr<int8_t>(), d, d + n * (in / 32), ggml_type);
        at::Tensor y = at::empty({n, out_features}, rows.options());
        block_linear_q8(quantized.const_data_ptr<int8_t>(), d, d + n * (in / 32), w, b, y.mutable_data_ptr<float>(), n, in, out_features,
                        ggml_type);
        return y;
    }
    if (n > kernel_rows || group > 1) { /* slabs of dequantized rows through torch's GEMM (whole groups) */
        const int64_t slab = std::max<int64_t>(8, SLAB_FLOATS / in / 8 * 8);
        at::Tensor weights = at::empty({slab, in}, rows.options());
        std::vector<at::Tensor> pieces;
        for (int64_t o = 0; o < out_features; o += slab) {
            const int64_t k = std::min(slab, out_features - o);
            block_rows(w + o * row_size, nullptr, k, in, ggml_type, weights.mutable_data_ptr<float>());
            pieces.push_back(at::mm(rows, weights.narrow(0, 0, k).t())); /* (N, k) */
        }
        at::Tensor y = at::cat(pieces, 1); /* (N, out) */
        return bias.has_value() ? y.add(*bias) : y;
    }
    at::Tensor y = at::empty({n, out_features}, rows.options());
    block_linear(x, w, b, y.mutable_data_ptr<float>(), n, in, out_features, ggml_type);
    return y;
}

/* y (N, out) = (x quantized by rows) W^T (row scale, scale) + bias, x (N, in) float32, W (out, in)
 * int8 as interleave_int8 lays it out, (ceil(out / 8), in / 32, 8, 8, 4), with a scale per output:
 * int8_rows_product's contract (model/quantize.py). */
at::Tensor int8_linear_kernel(const at::Tensor &rows, const at::Tensor &weight_x8, const at::Tensor &scale, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK_VALUE(rows.dim() == 2 && rows.scalar_type() == at::kFloat, "int8_linear: rows (N, in) float32");
    const int64_t n = rows.size(0), in = rows.size(1), out = scale.numel();
    const bool laid_out = weight_x8.dim() == 5 && weight_x8.size(0) == (out + 7) / 8 && weight_x8.size(1) * 32 == in && weight_x8.size(2) == 8 &&
                          weight_x8.size(3) == 8 && weight_x8.size(4) == 4;
    TORCH_CHECK_VALUE(laid_out && weight_x8.is_contiguous() && weight_x8.scalar_type() == at::kChar && in % 32 == 0 && in > 0,
                      "int8_linear: weight (out, ", in, ") contiguous int8 as interleave_int8 lays it out, in a multiple of 32");
    TORCH_CHECK_VALUE(scale.scalar_type() == at::kFloat && out > 0, "int8_linear: a float32 scale per output");
    TORCH_CHECK_VALUE(!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == out),
                      "int8_linear: bias (out,) contiguous float32");
    const at::Tensor x = rows.contiguous(), wscale = scale.reshape(-1).contiguous();
    at::Tensor y = at::empty({n, out}, x.options());
    const int status = int8_linear(x.const_data_ptr<float>(), weight_x8.const_data_ptr<int8_t>(), wscale.const_data_ptr<float>(),
                                   bias.has_value() ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), n, in, out);
    TORCH_CHECK(status != -2, "int8_linear: no memory for the quantized rows");
    TORCH_CHECK(status == 0, "int8_linear: no such kernel in this build");
    return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_serving, CPU, m) {
    m.impl("panel_linear", panel_linear_kernel);
    m.impl("paged_decode_attention", paged_decode_attention_kernel);
    m.impl("block_linear", block_linear_kernel);
    m.impl("int8_linear", int8_linear_kernel);
}
