"""Weights quantized at load (`quantization:` in a model's entry, `--quantization`): every linear
layer of a float32 model, and the output projection, kept in one of GGUF's block types
(model/block_quant.py) and multiplied by its kernels:

    int8, q8_0   Q8_0: 8-bit weights, a scale per 32 (8.5 bits a weight)
    q4_0         Q4_0: 4-bit weights, a scale per 32 (4.5 bits)
    q4_1         Q4_1: 4-bit weights, a scale and a min per 32 (5 bits)

The quantizers are the gguf package's (llama.cpp's reference rounding), so a model quantized here
holds what llama.cpp's converter would write. Activations, embeddings, norms and attention stay
float32; a layer whose input width is not a multiple of 32 stays float32 too. A row's output does
not depend on the other rows of its batch within a kernel call (each row's sums run in one
order). The outputs differ from float32's by rounding, so the path is held to quality bounds
(tests/model/test_quantize.py). On a GPU the weights are dequantized at each product: correct, not fast.
"""

import torch
from torch import nn

from model.block_quant import BLOCK, Q4_0, Q4_1, Q8_0, BlockLinear
from model.config import Quantization
from model.generator import Generator
from model.translator import Translator

GGML_TYPES: dict[str, int] = {"int8": Q8_0, "q8_0": Q8_0, "q4_0": Q4_0, "q4_1": Q4_1}
WeightType = torch.dtype | Quantization  # a float dtype, or float32 with quantized linear layers


def _quantized(linear: nn.Module, ggml_type: int) -> nn.Module:
    if not isinstance(linear, nn.Linear) or linear.in_features % BLOCK:
        return linear
    return BlockLinear.quantized(linear.weight, linear.bias, ggml_type)


def quantize_weights(model: Translator | Generator, quantization: Quantization = "int8") -> None:
    """Replaces, in place, every nn.Linear of a float32 model (an untied lm_head among them) by a
    BlockLinear of the quantization's type, and gives a tied model a quantized output projection
    (the embedding table itself stays float32). A logits bias stays float32."""
    ggml_type = GGML_TYPES[quantization]
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                parent.register_module(name, _quantized(child, ggml_type))
    if model.lm_head is None and model.embed.weight.shape[1] % BLOCK == 0:
        model.output_projection = BlockLinear.quantized(model.embed.weight, None, ggml_type)
    model.eval()


def place(model: Translator | Generator, device: str | torch.device, weights: WeightType) -> None:
    """Moves a float32 model, in place, to device in eval mode with weights of the given type."""
    if isinstance(weights, torch.dtype):
        model.to(device=device, dtype=weights).eval()
        return
    model.to(dtype=torch.float32)
    quantize_weights(model, weights)
    model.to(device).eval()
