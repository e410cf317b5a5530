"""The CPU's paged decode attention, a C kernel (model/csrc/paged_attention.c) compiled for this
machine's CPU on first use and loaded with ctypes: a decode step's attention reads each sequence's
keys and values in place in the block pool, once for all the query heads that share them, where
the plain path (model/kv_cache.py) first copies them out of their blocks and SDPA then reads each
key head once per query head. The plain path stays where there is no C compiler (the GPU image),
for other dtypes and devices, and for ALiBi's biased masks."""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
# -ffast-math lets gcc vectorise expf (glibc's libmvec) and the reductions; it is given to the
# compile only, not the link, so that the library does not switch the process's floating point
# to flush denormals (gcc links crtfastmath.o into a -ffast-math link).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-std=c11")
DISABLE_ENV = "TRANSFORMER_SERVING_NO_CPU_KERNELS"  # set (to anything): the plain path only


def cache_dir() -> Path:
    """Where built kernels are kept: $TRANSFORMER_SERVING_CACHE, else ~/.cache/transformer-serving."""
    default = Path.home() / ".cache" / "transformer-serving"
    return Path(os.environ.get("TRANSFORMER_SERVING_CACHE", default))


def _cpu_fingerprint() -> str:
    """This CPU's model and flags (-march=native code may not run on another)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("flags", "model name", "Features", "CPU part"))]
    return "\n".join(sorted(set(lines)))


def build(compiler: str, directory: Path) -> Path:
    """Compiles the kernel with `compiler` into `directory` (once per source, flags and CPU) and
    returns the shared library's path. Raises subprocess.CalledProcessError if it does not compile."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(COMPILE_FLAGS).encode() + _cpu_fingerprint().encode()).hexdigest()[:16]
    library = directory / f"paged_attention-{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        obj, built = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)], check=True, capture_output=True)
        subprocess.run([compiler, "-shared", str(obj), "-o", str(built), "-lm"], check=True, capture_output=True)
        os.replace(built, library)  # atomic: replicas building at once each install a whole library
    return library


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The loaded kernel, or None (no C compiler, it failed to build, or DISABLE_ENV is set)."""
    if os.environ.get(DISABLE_ENV) or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler: paged decode attention runs through SDPA")
        return None
    try:
        library = ctypes.CDLL(str(build(compiler, cache_dir())))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr.decode(errors="replace") if isinstance(error, subprocess.CalledProcessError) else str(error)
        logger.warning("the CPU paged attention kernel did not build (%s): SDPA instead", detail.strip()[-500:])
        return None
    function = library.paged_decode_attention
    function.restype = ctypes.c_int
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, pointer, pointer, size, pointer, pointer, size, size, size, size, size, ctypes.c_float]
    return function


def applies(pool: Tensor) -> bool:
    """Whether the kernel can attend over this pool (num_blocks, block_size, Hkv, D): float32 on the
    CPU, and the kernel built. (Masks with ALiBi's bias are the caller's to keep from it.)"""
    return pool.device.type == "cpu" and pool.dtype == torch.float32 and kernel() is not None


def paged_decode_attention(queries: Tensor, keys: Tensor, values: Tensor, key_blocks: Tensor, lengths: Tensor) -> Tensor:
    """Attention (B, H, D) of queries (B, H, D), each row b over the first lengths[b] keys and values
    of its blocks key_blocks[b] (B, nb) in the pools keys, values (num_blocks, block_size, Hkv, D),
    scaled by 1/sqrt(D); query head h reads key head h // (H / Hkv). Requires `applies`."""
    function = kernel()
    assert function is not None, "paged_decode_attention without its kernel (check applies())"
    B, H, D = queries.shape
    _, block_size, Hkv, _ = keys.shape
    assert keys.is_contiguous() and values.is_contiguous() and H % Hkv == 0
    queries = queries.contiguous()
    key_blocks, lengths = key_blocks.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    out = torch.empty(B, H, D)
    status = function(
        queries.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        key_blocks.data_ptr(),
        key_blocks.shape[1],
        lengths.data_ptr(),
        out.data_ptr(),
        B,
        H,
        Hkv,
        D,
        block_size,
        D**-0.5,
    )
    if status == -2:
        raise ValueError(f"paged_decode_attention: lengths past the rows' {key_blocks.shape[1]} blocks of {block_size}")
    if status != 0:
        raise MemoryError("paged_decode_attention: out of memory for its scores")
    return out
