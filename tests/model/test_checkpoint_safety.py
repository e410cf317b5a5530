"""Weights load only through safetensors: a pickle in place of a checkpoint is refused and runs
nothing, and training's resume (training/train.py) reads its state.pt with `weights_only=True`."""

import ast
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError

from loading.checkpoint import DEFAULT_GENERATOR, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling this creates the marker file: what a malicious checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def write_payload(path: Path, marker: Path, kind: str) -> None:
    if kind == "pickle":
        path.write_bytes(pickle.dumps(Payload(marker)))
    else:  # torch.save's zip archive, what a .pt or .bin checkpoint is
        torch.save({"model": Payload(marker)}, path)


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_a_pickle_in_place_of_the_weights_is_refused_and_runs_nothing(tmp_path: Path, kind: str) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for name in ("config.json", "tokenizer.model", "training.json"):
        shutil.copy(DEFAULT_GENERATOR / name, checkpoint / name)
    marker = tmp_path / "pwned"
    write_payload(checkpoint / "model.safetensors", marker, kind)
    with pytest.raises(SafetensorError):
        load_checkpoint(checkpoint)
    assert not marker.exists()
    if kind == "pickle":  # the payload is armed: unpickling it would have run it
        pickle.loads((checkpoint / "model.safetensors").read_bytes())
        assert marker.exists()


def test_training_resume_refuses_a_pickled_state(tmp_path: Path) -> None:
    """training/train.py resumes with `torch.load(state_path, ..., weights_only=True)`: the same call
    on a state.pt carrying code refuses it before running anything."""
    marker = tmp_path / "pwned"
    write_payload(tmp_path / "state.pt", marker, "torch.save")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=True)
    assert not marker.exists()
    torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=False)  # armed: a full unpickle runs it
    assert marker.exists()


def calls_and_imports(package: str) -> tuple[list[tuple[str, ast.Call]], set[str]]:
    """Every call of `torch.load` (with its file) and every imported module under package."""
    loads, imported = [], set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                loads.append((str(path.relative_to(ROOT)), node))
    return loads, imported


@pytest.mark.parametrize("package", ["model", "loading", "decoding", "exports", "training", "service"])
def test_nothing_is_unpickled_but_through_weights_only(package: str) -> None:
    loads, imported = calls_and_imports(package)
    assert not imported & {"pickle", "dill", "cloudpickle", "joblib"}
    for path, call in loads:
        weights_only = [k.value for k in call.keywords if k.arg == "weights_only"]
        assert len(weights_only) == 1 and isinstance(weights_only[0], ast.Constant) and weights_only[0].value is True, path
    expected = {"loading": ["loading/hf/load.py"], "training": ["training/train.py"]}  # weights_only, checked above
    assert sorted(path for path, _ in loads) == expected.get(package, [])
