/* The CPU kernels of the operators torch.ops.transformer_serving.panel_linear and
 * paged_decode_attention, in C++: a call, from a compiled graph or eagerly, goes from torch's
 * dispatcher to the C kernel (panel_linear.c, paged_attention.c) without Python: 1.4-2 us a call
 * more than the C kernel alone, where their Python functions (model/packed_linear.py,
 * model/paged_attention_cpu.py) cost 6-7 us more (a compiled decode step of the shipped generator
 * makes 31 calls: docs/performance.md). The operators' schemas are defined in Python
 * (model/cpu_kernels.py: register_operator), from those functions, which these kernels equal.
 * Built and loaded by model/cpu_kernels.py, linked against the C kernels' library. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>

extern "C" {
void panel_linear(const float *x, const float *panels, const float *bias, float *y, int64_t rows, int64_t in, int64_t out);
int64_t panel_linear_max_rows(void);
int paged_decode_attention(const float *q, const float *keys, const float *values, const int64_t *block_tables, int64_t table_stride,
                           const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                           int64_t num_blocks, float scale);
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

}  // namespace

TORCH_LIBRARY_IMPL(transformer_serving, CPU, m) {
    m.impl("panel_linear", panel_linear_kernel);
    m.impl("paged_decode_attention", paged_decode_attention_kernel);
}
