"""Running a test on a C kernel of decoding/top_k_cpu.py and on torch's path in its place."""

import pytest

from decoding import top_k_cpu


def kernel_or_torch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, loader: str) -> str:
    """request.param "kernel": the kernel top_k_cpu.<loader>() loads (the test skipped where it does
    not build); "torch": that loader answering None, so torch's operations run. Returns the param."""
    if request.param == "kernel" and getattr(top_k_cpu, loader)() is None:
        pytest.skip("the CPU kernels are off")
    if request.param == "torch":
        monkeypatch.setattr(top_k_cpu, loader, lambda: None)
    return str(request.param)
