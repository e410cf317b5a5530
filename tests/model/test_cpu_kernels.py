"""How the C kernels (model/cpu_kernels.py) are built, cached and turned off."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import Tensor

from model import cpu_kernels


def test_it_is_built_once_per_source_and_cpu(tmp_path: Path) -> None:
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = cpu_kernels.build(compiler, tmp_path)
    built_at = library.stat().st_mtime_ns
    assert cpu_kernels.build(compiler, tmp_path) == library and library.stat().st_mtime_ns == built_at
    assert [p.name for p in tmp_path.iterdir()] == [library.name], "scratch files left behind"


def test_every_source_is_in_the_library(tmp_path: Path) -> None:
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    symbols = subprocess.run(["nm", "-D", str(cpu_kernels.build(compiler, tmp_path))], check=True, capture_output=True, text=True).stdout
    assert {source.stem for source in cpu_kernels.SOURCES} == {"paged_attention", "panel_linear", "top_k"}
    assert " T paged_decode_attention" in symbols and " T panel_linear" in symbols and " T row_top_k" in symbols


def test_a_compiler_that_fails_raises_and_installs_nothing(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        cpu_kernels.build("false", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_environment_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    assert cpu_kernels.library.__wrapped__() is None


def test_a_registered_operator_runs_its_function_eagerly_and_in_a_compiled_graph() -> None:
    def scaled_sum(rows: Tensor, scale: float) -> Tensor:
        return rows.sum(-1) * scale

    def shape(rows: Tensor, scale: float) -> Tensor:
        return rows.new_empty(rows.shape[:-1])

    cpu_kernels.register_operator("test_scaled_sum", scaled_sum, shape)
    operator = torch.ops.transformer_serving.test_scaled_sum
    rows = torch.randn(5, 7)
    assert torch.equal(operator(rows, 2.0), scaled_sum(rows, 2.0))
    graph = torch.compile(lambda x: operator(x + 1, 0.5) * 3, backend="aot_eager", fullgraph=True)
    assert torch.allclose(graph(rows), scaled_sum(rows + 1, 0.5) * 3)
    assert "test_scaled_sum" in str(operator.default._schema)
