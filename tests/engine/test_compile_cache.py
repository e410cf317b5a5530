"""torch.compile's artifacts kept between starts (service/engine/compile_cache.py): an entry saved
after compiling loads before the next compile; a corrupt, altered or refused entry is deleted and
reported as a miss, never trusted; keys differ with what the code depends on."""

import hashlib
from pathlib import Path

import torch

from service.engine.compile_cache import DIGEST_BYTES, CompileCache


def compile_something() -> None:
    function = torch.compile(lambda x: (x.sin() * 3 + 1).sum(), dynamic=False)
    function(torch.arange(7, dtype=torch.float32))


def test_an_entry_saved_after_compiling_is_loaded_and_a_bad_one_is_deleted(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "torch-compile")
    key = cache.key("a model", "float32")
    assert not cache.load(key)  # nothing yet
    compile_something()
    cache.save(key)
    entry = cache.path(key)
    assert entry.is_file() and entry.stat().st_size > DIGEST_BYTES
    assert cache.load(key)

    data = entry.read_bytes()
    entry.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit changed: the checksum no longer matches
    assert not cache.load(key) and not entry.exists()

    entry.write_bytes(b"\0" * DIGEST_BYTES)  # no payload: a checksum of nothing that does not match
    assert not cache.load(key) and not entry.exists()

    garbage = b"not torch's artifacts"
    entry.write_bytes(hashlib.sha256(garbage).digest() + garbage)  # a matching checksum: torch refuses the bytes
    assert not cache.load(key) and not entry.exists()


def test_keys_differ_with_what_the_compiled_code_depends_on() -> None:
    assert CompileCache.key("a", "b") == CompileCache.key("a", "b")
    assert len({CompileCache.key("a", "b"), CompileCache.key("a", "c"), CompileCache.key("a")}) == 3
