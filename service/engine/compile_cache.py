"""torch.compile's artifacts kept between starts (torch.compiler.save_cache_artifacts and
load_cache_artifacts: inductor's compiled code and AOT autograd's graphs), one file per key in a
directory a deployment can mount: $TRANSFORMER_SERVING_CACHE/torch-compile by default (beside the
C kernels' builds, model/cpu_kernels.py cache_dir).

A key names everything the compiled code depends on: torch's and Python's versions, the CPU (its
model and flags), the C kernels' and operators' builds, and what the caller adds (the model's
shapes, dtype, device, batch sizes). An entry holds a SHA-256 of its bytes: one that does not match,
or that torch refuses, is deleted and compiled again, never trusted."""

import hashlib
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from model.cpu_kernels import cache_dir, cpu_fingerprint, library, native_operators

logger = logging.getLogger(__name__)

DIGEST_BYTES = 32


def default_directory() -> Path:
    return cache_dir() / "torch-compile"


class CompileCache:
    """Contract: `load(key)` before compiling returns whether that key's artifacts were loaded into
    torch's caches (False for none, and for a corrupt or refused entry, which it deletes); `save(key)`
    after compiling writes the artifacts this process has compiled, atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @staticmethod
    def key(*parts: str) -> str:
        kernels = library()
        builds = [Path(kernels._name).name if kernels is not None else "no-kernels", *sorted(native_operators())]
        environment = [torch.__version__, sys.version, platform.machine(), cpu_fingerprint(), *builds]
        return hashlib.sha256("\n".join([*environment, *parts]).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.bin"

    def load(self, key: str) -> bool:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return False
        digest, payload = data[:DIGEST_BYTES], data[DIGEST_BYTES:]
        try:
            if hashlib.sha256(payload).digest() != digest:
                raise ValueError("its checksum does not match")
            if torch.compiler.load_cache_artifacts(payload) is None:
                raise ValueError("torch refused its artifacts")
        except Exception as error:  # torch's own refusal of the bytes included
            logger.warning("compile cache entry %s refused (%s): deleted, compiling again", path, error)
            path.unlink(missing_ok=True)
            return False
        logger.info("compile cache entry %s loaded (%d bytes)", path, len(payload))
        return True

    def save(self, key: str) -> None:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return
        payload = artifacts[0]
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as file:
            file.write(hashlib.sha256(payload).digest() + payload)
        os.replace(file.name, self.path(key))  # atomic: replicas saving at once each write a whole entry
        logger.info("compile cache entry %s saved (%d bytes)", self.path(key), len(payload))
