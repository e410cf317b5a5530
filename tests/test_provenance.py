"""What a benchmark's JSON says of where its figures came from (benchmarks/provenance.py)."""

import os
from pathlib import Path

from benchmarks import provenance


def test_the_machine_names_its_cores_model_and_widest_vector_extension(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n")
    assert provenance.machine(cpuinfo) == f"{os.cpu_count()} CPU cores, AMD EPYC 7B13, AVX2"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: avx2 avx512f avx512bw\n")
    assert provenance.machine(cpuinfo).endswith("Intel(R) Xeon(R), AVX-512")
    assert provenance.machine(tmp_path / "absent") == f"{os.cpu_count()} CPU cores, unknown, no AVX2"
