"""This project's C kernels for the CPU (model/csrc/*.c), compiled together for this machine's CPU
on first use and loaded with ctypes: the paged decode attention (model/paged_attention_cpu.py) and
the few-row linear layers (model/packed_linear.py). Where there is no C compiler (the GPU image),
on other systems than Linux, or with DISABLE_ENV set, `library()` is None and their callers take
torch's paths.

Two of them are also torch operators with C++ kernels (model/csrc/operators.cpp, built against
torch's headers where a C++ compiler is found: `native_operators()`), so that a compiled graph's
call runs no Python; elsewhere their Python functions serve the operators."""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.c")))
OPERATORS_SOURCE = Path(__file__).parent / "csrc" / "operators.cpp"
NATIVE_OPERATORS = frozenset({"panel_linear", "paged_decode_attention", "block_linear", "int8_linear"})  # those operators.cpp implements
# -ffast-math lets gcc vectorise expf (glibc's libmvec) and the reductions; it is given to the
# compile only, not the link, so that the library does not switch the process's floating point
# to flush denormals (gcc links crtfastmath.o into a -ffast-math link).
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp-simd", "-fPIC", "-std=gnu11")  # and build()'s -march
DISABLE_ENV = "TRANSFORMER_SERVING_NO_CPU_KERNELS"  # set (to anything): torch's paths only
# Set to "address": the kernels and operators are built with AddressSanitizer (the process must
# load libasan first, LD_PRELOAD: tests/model/test_kernels_asan.py), in libraries of their own.
SANITIZE_ENV = "TRANSFORMER_SERVING_SANITIZE"
# The kernels as torch operators, torch.ops.transformer_serving.NAME: what a compiled step's graph calls.
OPERATORS = torch.library.Library("transformer_serving", "FRAGMENT")


def cache_dir() -> Path:
    """Where built kernels are kept: $TRANSFORMER_SERVING_CACHE, else ~/.cache/transformer-serving."""
    default = Path.home() / ".cache" / "transformer-serving"
    return Path(os.environ.get("TRANSFORMER_SERVING_CACHE", default))


def cpu_fingerprint() -> str:
    """This CPU's model and flags (-march=native code may not run on another)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("flags", "model name", "Features", "CPU part"))]
    return "\n".join(sorted(set(lines)))


def sanitizer_flags() -> tuple[str, ...]:
    """The compiler's sanitizer flags SANITIZE_ENV asks for (none when it is unset); ValueError for a sanitizer other than address."""
    sanitizer = os.environ.get(SANITIZE_ENV, "")
    if sanitizer not in ("", "address"):
        raise ValueError(f"{SANITIZE_ENV}={sanitizer!r}: only 'address' is supported")
    return ("-fsanitize=address", "-fno-omit-frame-pointer") if sanitizer else ()


def sanitizer_name() -> str:
    """The prefix of a sanitized build's library name ("asan-"), "" otherwise."""
    return "asan-" if sanitizer_flags() else ""


def build(compiler: str, directory: Path, march: str = "native") -> Path:
    """Compiles the kernels with `compiler` for gcc's -march=`march` (native: this CPU; the tests
    build other vector widths) into one shared library in `directory` (once per sources, flags and
    CPU) and returns its path. Raises subprocess.CalledProcessError if they do not compile."""
    flags = (*COMPILE_FLAGS, f"-march={march}", *sanitizer_flags())
    digest = hashlib.sha256(" ".join(flags).encode() + cpu_fingerprint().encode())
    for source in SOURCES:
        digest.update(source.name.encode() + source.read_bytes())
    library = directory / f"cpu-kernels-{sanitizer_name()}{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        for source, obj in zip(SOURCES, objects, strict=True):
            subprocess.run([compiler, *flags, "-c", str(source), "-o", str(obj)], check=True, capture_output=True)
        built = Path(scratch) / "kernels.so"
        subprocess.run(
            [compiler, "-shared", *sanitizer_flags(), *map(str, objects), "-o", str(built), "-lm"], check=True, capture_output=True
        )
        os.replace(built, library)  # atomic: replicas building at once each install a whole library
    return library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no C compiler, they failed to build, or DISABLE_ENV is set)."""
    if os.environ.get(DISABLE_ENV) or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler: the CPU kernels are off, torch's paths run instead")
        return None
    try:
        return ctypes.CDLL(str(build(compiler, cache_dir())))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr.decode(errors="replace") if isinstance(error, subprocess.CalledProcessError) else str(error)
        logger.warning("the CPU kernels did not build (%s): torch's paths instead", detail.strip()[-500:])
        return None


def build_operators(compiler: str, kernels: Path) -> Path:
    """Compiles OPERATORS_SOURCE with the C++ `compiler` against this torch's headers into a shared
    library next to `kernels` (the C kernels' library, built by `build`, which it links to), once per
    source, kernels and torch build, and returns its path. Raises subprocess.CalledProcessError if it
    does not compile."""
    torch_folder = Path(torch.__file__).parent  # its headers in include/, its libraries in lib/
    torch_libraries = str(torch_folder / "lib")
    flags = (
        "-O2",
        "-std=c++20",
        "-fPIC",
        "-shared",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{torch_folder / 'include'}",
        *sanitizer_flags(),
    )
    digest = hashlib.sha256(" ".join(flags).encode() + torch.__version__.encode() + kernels.name.encode() + OPERATORS_SOURCE.read_bytes())
    library = kernels.parent / f"cpu-operators-{sanitizer_name()}{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=kernels.parent) as scratch:
        built = Path(scratch) / "operators.so"
        links = (f"-L{kernels.parent}", f"-l:{kernels.name}", f"-L{torch_libraries}", "-ltorch_cpu", "-lc10")
        rpaths = ("-Wl,-rpath,$ORIGIN", f"-Wl,-rpath,{torch_libraries}")
        subprocess.run([compiler, *flags, str(OPERATORS_SOURCE), "-o", str(built), *links, *rpaths], check=True, capture_output=True)
        os.replace(built, library)
    return library


@functools.cache
def native_operators() -> frozenset[str]:
    """The operators (NATIVE_OPERATORS) whose CPU kernels are operators.cpp's, loaded into torch's
    dispatcher; empty where the C kernels are off or it does not build (no C++ compiler)."""
    kernels = library()
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if kernels is None or compiler is None:
        return frozenset()
    try:
        torch.ops.load_library(build_operators(compiler, Path(kernels._name)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr.decode(errors="replace") if isinstance(error, subprocess.CalledProcessError) else str(error)
        logger.warning("the C++ operators did not build (%s): their Python functions instead", detail.strip()[-500:])
        return frozenset()
    return NATIVE_OPERATORS


def load_function(name: str, restype: type | None, argtypes: Sequence[type]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernels' C function `name` with its result and argument types set, or None where the
    kernels are off."""
    loaded = library()
    if loaded is None:
        return None
    function = getattr(loaded, name)
    function.restype, function.argtypes = restype, list(argtypes)
    return function


def register_operator(name: str, function: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Makes `function` (it mutates none of its arguments, and its output aliases none of them) the
    CPU kernel of the operator torch.ops.transformer_serving.<name>, and `fake` its shape function
    for torch.compile's tracing; its schema is read from `function`. Where operators.cpp implements
    the operator (`native_operators()`), that C++ kernel, which must equal `function`, is the CPU
    kernel instead. `function` is registered on the dispatcher directly, as vLLM's
    direct_register_custom_op does: a call then costs 2-3 us more than calling it, where
    torch.library.custom_op's checks (aliasing, autograd, dispatch) cost 10-14 us more (a compiled
    decode step calls some 30 of them). It serves oneDNN's tensors too (an argument in oneDNN's
    packed layout takes the dispatcher to MkldnnCPU, not CPU).

    Returns how callers call it: the operator under torch.compile (one opaque operation) and where
    its kernel is C++ (cheaper to call than `function`), else `function` itself."""
    OPERATORS.define(name + torch.library.infer_schema(function, mutates_args=()))
    native = name in native_operators()
    for dispatch_key in ("MkldnnCPU",) if native else ("CPU", "MkldnnCPU"):
        OPERATORS.impl(name, function, dispatch_key)
    OPERATORS._register_fake(name, fake)
    operator = getattr(torch.ops.transformer_serving, name)

    def call(*args: Any) -> torch.Tensor:
        return operator(*args) if native or torch.compiler.is_compiling() else function(*args)

    return call
