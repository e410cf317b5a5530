"""A replica's weight type from its serving config: float32 on the CPU by default, int8 weights
on request (CPU only: asked for on a GPU, the replica refuses to start with a clear error)."""

import pytest
import torch

from loading.checkpoint import DEFAULT_GENERATOR
from service.config import ModelServingConfig
from service.deployments import resolve_device


def config(**kwargs: str) -> ModelServingConfig:
    return ModelServingConfig(name="m", checkpoint=DEFAULT_GENERATOR, **kwargs)  # type: ignore[arg-type]


def test_cpu_defaults_to_float32_and_takes_int8_on_request() -> None:
    assert resolve_device(config(device="cpu")) == ("cpu", torch.float32)
    assert resolve_device(config(device="cpu", dtype="int8")) == ("cpu", "int8")
    assert resolve_device(config(device="cpu", dtype="bfloat16")) == ("cpu", torch.bfloat16)


def test_int8_on_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        resolve_device(config(device="cuda", dtype="int8"))


def test_an_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="dtype"):
        config(device="cpu", dtype="int4")
