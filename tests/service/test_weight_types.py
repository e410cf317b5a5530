"""A replica's weight type from its serving config: float32 on the CPU by default, quantized
weights on request (on a GPU too, dequantized at each product); a GGUF file keeps its own types."""

import pytest
import torch

from loading.checkpoint import DEFAULT_GENERATOR
from service.config import ModelServingConfig
from service.deployments import resolve_device


def config(**kwargs: str) -> ModelServingConfig:
    return ModelServingConfig(name="m", checkpoint=DEFAULT_GENERATOR, **kwargs)  # type: ignore[arg-type]


def test_cpu_defaults_to_float32_and_takes_quantized_weights_on_request() -> None:
    assert resolve_device(config(device="cpu")) == ("cpu", torch.float32)
    for quantization in ["int8", "q8_0", "q4_0", "q4_1"]:
        assert resolve_device(config(device="cpu", quantization=quantization)) == ("cpu", quantization)
        assert resolve_device(config(device="cuda", quantization=quantization)) == ("cuda", quantization)
    assert resolve_device(config(device="cpu", dtype="bfloat16")) == ("cpu", torch.bfloat16)


def test_an_unknown_quantization_and_int8_as_a_dtype_are_config_errors() -> None:
    with pytest.raises(ValueError, match="quantization"):
        config(device="cpu", quantization="q3_k")
    with pytest.raises(ValueError, match="int8"):
        config(device="cpu", dtype="int8")  # the weights' type is quantization's now


def test_an_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="dtype"):
        config(device="cpu", dtype="int4")
