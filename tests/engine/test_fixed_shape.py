"""The fixed-shape decode step (what the GPU captures as a CUDA graph) computes what the
dynamic step computes."""

import copy

import pytest
import torch

from model.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from model.generator import Generator
from model.sampling import GREEDY
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner
from tests.helpers import PROMPTS, FakeTokenizer, context_sensitive_generator, run


def tokens_with(fixed_shape: bool, device: str = "cpu", model: Generator | None = None) -> dict[str, list[int]]:
    model = copy.deepcopy(model or context_sensitive_generator()).to(device)  # the shared one stays on the CPU
    engine = Engine(GeneratorRunner(model, FakeTokenizer(), n_slots=6, fixed_shape_decode=fixed_shape), EngineConfig(n_slots=6))  # type: ignore[arg-type]
    requests = [Request(f"r{i}", p, GenerationParams(sampling=GREEDY, max_tokens=8 + 3 * i)) for i, p in enumerate(PROMPTS)]
    return run(engine, {0: requests[:2], 3: requests[2:]})


def test_fixed_shape_decode_equals_dynamic_decode_on_cpu() -> None:
    assert tokens_with(fixed_shape=True) == tokens_with(fixed_shape=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_eager_decode_on_gpu() -> None:
    assert tokens_with(fixed_shape=True, device="cuda") == tokens_with(fixed_shape=False, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shipped_checkpoints_serve_in_bfloat16_on_gpu() -> None:
    for checkpoint in (DEFAULT_GENERATOR, DEFAULT_TRANSLATOR):
        engine = Engine.from_checkpoint(checkpoint, EngineConfig(n_slots=8), "cuda", torch.bfloat16)
        prompt = engine.runner.encode_prompt("A man is riding a bike.")
        tokens = run(engine, {0: [Request("x", prompt, GenerationParams(sampling=GREEDY, max_tokens=20))]})
        assert tokens["x"], f"{checkpoint.name} produced nothing on the GPU"
