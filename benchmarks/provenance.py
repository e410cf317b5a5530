"""Where a benchmark's figures came from, written into its JSON: the commit they were measured at and
the machine they were measured on."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checked-out commit, `-dirty` when the work tree differs from it ("unknown" outside a git checkout)."""
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    return described.stdout.strip() or "unknown"


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU the figures were measured on: its cores, model and widest vector extension as
    `cpuinfo` (Linux's) tells them, as "2 CPU cores, Intel(R) Xeon(R) Processor, AVX-512" (the
    model "unknown" where there is no such file)."""
    try:
        info = cpuinfo.read_text()
    except OSError:
        info = ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith(("flags", "Features"))), []))
    widest = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON")) if flag in flags), "no AVX2")
    return f"{os.cpu_count()} CPU cores, {model}, {widest}"
