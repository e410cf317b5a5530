"""How the C kernels (model/cpu_kernels.py) and the C++ operators over them are built, cached and
turned off, and that the operators' C++ kernels equal their Python functions."""

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from model import cpu_kernels, paged_attention_cpu
from model.packed_linear import panel_product, to_panels


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
    assert {source.stem for source in cpu_kernels.SOURCES} == {"block_linear", "paged_attention", "panel_linear", "top_k"}
    assert " T paged_decode_attention" in symbols and " T panel_linear" in symbols and " T row_top_k" in symbols
    assert " T block_linear" in symbols and " T block_rows" in symbols


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

    call = cpu_kernels.register_operator("test_scaled_sum", scaled_sum, shape)
    operator = torch.ops.transformer_serving.test_scaled_sum
    rows = torch.randn(5, 7)
    assert torch.equal(operator(rows, 2.0), scaled_sum(rows, 2.0))
    graph = torch.compile(lambda x: operator(x + 1, 0.5) * 3, backend="aot_eager", fullgraph=True)
    assert torch.allclose(graph(rows), scaled_sum(rows + 1, 0.5) * 3)
    assert "test_scaled_sum" in str(operator.default._schema)

    # What register_operator returns: the function eagerly (no C++ kernel here), one operation in a graph.
    assert torch.equal(call(rows, 2.0), scaled_sum(rows, 2.0))
    traced: list[torch.fx.GraphModule] = []

    def capture(module: torch.fx.GraphModule, inputs: list[Tensor]) -> Callable[..., Any]:
        traced.append(module)
        return module.forward

    assert torch.allclose(torch.compile(lambda x: call(x + 1, 0.5), backend=capture, fullgraph=True)(rows), scaled_sum(rows + 1, 0.5))
    (module,) = traced
    assert [n.target for n in module.graph.nodes if n.op == "call_function"][-1] in (operator, operator.default)  # not its body


def test_the_cpp_operators_are_built_once_against_the_kernels(tmp_path: Path) -> None:
    compilers = shutil.which("cc"), shutil.which("c++")
    if None in compilers:
        pytest.skip("no C or C++ compiler")
    kernels = cpu_kernels.build(str(compilers[0]), tmp_path)
    operators = cpu_kernels.build_operators(str(compilers[1]), kernels)
    built_at = operators.stat().st_mtime_ns
    assert cpu_kernels.build_operators(str(compilers[1]), kernels) == operators and operators.stat().st_mtime_ns == built_at
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kernels.name, operators.name]), "scratch files left behind"
    needed = subprocess.run(["readelf", "-d", str(operators)], check=True, capture_output=True, text=True).stdout
    assert f"[{kernels.name}]" in needed  # the kernels' code is linked to, not copied


def test_a_cpp_compiler_that_fails_raises_and_installs_nothing(tmp_path: Path) -> None:
    kernels = tmp_path / "cpu-kernels-0.so"
    kernels.touch()
    with pytest.raises(subprocess.CalledProcessError):
        cpu_kernels.build_operators("false", kernels)
    assert list(tmp_path.iterdir()) == [kernels]


def test_without_the_kernels_no_operator_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    assert cpu_kernels.native_operators.__wrapped__() == frozenset()


def test_the_operators_kernels_are_cpp_where_there_is_a_cpp_compiler() -> None:
    """CI and this project's machines have one: the equality tests below must not be comparing
    the Python functions with themselves."""
    if shutil.which("cc") is None or shutil.which("c++") is None:
        pytest.skip("no C or C++ compiler")
    expected = {"panel_linear", "paged_decode_attention", "block_linear", "int8_linear"}
    assert cpu_kernels.native_operators() == cpu_kernels.NATIVE_OPERATORS == expected


@pytest.mark.parametrize("rows", [1, 5, 9, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_the_cpp_panel_operator_equals_its_python_function(rows: int, bias: bool) -> None:
    if "panel_linear" not in cpu_kernels.native_operators():
        pytest.skip("the C++ operators did not build here")
    torch.manual_seed(0)
    weight = torch.randn(1000, 256)
    panels, b = to_panels(weight), torch.randn(1000) if bias else None
    x = torch.randn(rows, 512)[:, ::2]  # not contiguous: both copy it
    got = torch.ops.transformer_serving.panel_linear(x, panels, b, 1000)
    assert torch.equal(got, panel_product(x, panels, b, 1000))
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
def test_the_cpp_attention_operator_equals_its_python_function(heads: int, kv_heads: int) -> None:
    if "paged_decode_attention" not in cpu_kernels.native_operators():
        pytest.skip("the C++ operators did not build here")
    torch.manual_seed(0)
    keys, values = torch.randn(9, 16, kv_heads, 40), torch.randn(9, 16, kv_heads, 40)
    queries = torch.randn(3, heads, 40)
    key_blocks = torch.tensor([[3, 1, 0], [2, 5, 7], [8, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([20, 48, 1], dtype=torch.int32)
    got = torch.ops.transformer_serving.paged_decode_attention(queries, keys, values, key_blocks, lengths)
    assert torch.equal(got, paged_attention_cpu._kernel_attention(queries, keys, values, key_blocks, lengths))
    with pytest.raises(ValueError, match="past the rows' 3 blocks of 16"):
        torch.ops.transformer_serving.paged_decode_attention(queries, keys, values, key_blocks, lengths + 48)
