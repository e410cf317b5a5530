"""The C kernels and their C++ operators built with AddressSanitizer (model/cpu_kernels.py
SANITIZE_ENV), their equality and refusal tests run under it in a process that loads libasan first:
no read or write outside their buffers. A call that reads past a tensor on purpose (the raw C
function, past the wrapper's checks) shows that the sanitizer is watching. `make test-long`."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
UNDER_ASAN = [
    "tests/model/test_kernel_refusals.py",
    "tests/model/test_paged_attention_cpu.py",
    "tests/model/test_top_k_cpu.py",
    "tests/model/test_cpu_kernels.py::test_the_cpp_panel_operator_equals_its_python_function",
    "tests/model/test_cpu_kernels.py::test_the_cpp_attention_operator_equals_its_python_function",
    "tests/model/test_packed_linear.py::test_packed_linear_equals_the_plain_layer",
    "tests/model/test_packed_linear.py::test_inputs_of_any_width_equal_the_plain_layer",  # the unrolled k loops' remainders
    # the argmax kernel's paths: half panels (257 rows), row groups (9, 3 rows), part panels, bias
    "tests/model/test_packed_linear.py::test_the_argmax_kernel_is_the_argmax_of_the_products[257-1000-True]",
    "tests/model/test_packed_linear.py::test_the_argmax_kernel_is_the_argmax_of_the_products[9-40-False]",
    "tests/model/test_packed_linear.py::test_the_argmax_kernel_is_the_argmax_of_the_products[3-3-True]",
    "tests/model/test_gguf.py::test_interleaved_blocks_hold_the_files_bytes_and_compute_what_they_do",
    "tests/model/test_gguf.py::test_the_cpp_block_operator_equals_its_python_function",
    "tests/model/test_gguf.py::test_the_cpp_block_operator_refuses_shapes_and_dtypes_not_its_own",
    "tests/model/test_quantize.py::test_the_cpp_int8_operator_equals_its_python_function_and_refuses_what_is_not_its_own",
    "tests/model/test_quantize.py::test_the_int8_kernel_gives_a_row_with_a_nan_or_an_infinity_nan_outputs_and_leaves_the_others_alone",
    "tests/model/test_quantize.py::test_a_rows_output_does_not_depend_on_its_batch",
]
OVERREAD = """
import ctypes, torch
from decoding import top_k_cpu
from model import cpu_kernels
assert "asan-" in cpu_kernels.library()._name
logits, values, ids = torch.zeros(1, 64), torch.empty(1, 1), torch.empty(1, 1, dtype=torch.long)
top_k_cpu.kernel()(logits.data_ptr(), None, 1, 4096, 1, values.data_ptr(), ids.data_ptr(), None, None)  # 4,096 of 64 logits
"""


@pytest.fixture
def asan_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a process whose kernels are built (into tmp_path) and run under AddressSanitizer."""
    compiler = shutil.which("cc")
    if compiler is None or shutil.which("c++") is None:
        pytest.skip("no C or C++ compiler")
    libasan, libstdcxx = (
        subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        for name in ("libasan.so", "libstdc++.so")
    )
    if not Path(libasan).is_file() or not Path(libstdcxx).is_file():
        pytest.skip("the compiler has no libasan (or no libstdc++)")
    return {
        **os.environ,
        # libstdc++ too, before torch loads it: ASan's interceptor of C++ throws (torch's errors) needs it
        "LD_PRELOAD": f"{libasan} {libstdcxx}",
        "ASAN_OPTIONS": "detect_leaks=0",  # Python and torch keep memory to the end on purpose
        cpu_kernels.SANITIZE_ENV: "address",
        "TRANSFORMER_SERVING_CACHE": str(tmp_path),
    }


def test_the_kernels_equality_and_refusal_tests_pass_under_addresssanitizer_which_catches_a_read_past_a_tensor(
    asan_environment: dict[str, str], tmp_path: Path
) -> None:
    """One test, so that the sanitized kernels and operators are built once (a minute and more)."""
    # -s: a sanitizer's report goes to the process's stderr, not into pytest's capture it would end with it
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:xdist", *UNDER_ASAN]
    done = subprocess.run(command, cwd=ROOT, env=asan_environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]  # every kernel built and ran
    assert [p.name for p in tmp_path.glob("cpu-kernels-asan-*.so")] and [p.name for p in tmp_path.glob("cpu-operators-asan-*.so")]
    overread = subprocess.run([sys.executable, "-c", OVERREAD], cwd=ROOT, env=asan_environment, capture_output=True, text=True, timeout=300)
    assert overread.returncode != 0  # the sanitizer is watching
    assert "heap-buffer-overflow" in overread.stderr, overread.stderr[-3000:]
