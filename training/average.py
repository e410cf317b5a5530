"""Checkpoint averaging: the element-wise mean of several snapshots' weights (as in Vaswani et al.
2017 and Marian), written as a checkpoint folder.

    python -m training.average --out runs/translator-2/average runs/translator-2/step-002750 runs/translator-2/step-003000

The snapshots must share config.json and tokenizer. The mean is taken in float32 and stored in the
snapshots' dtype when they all share one (else float32), so averaging copies of one checkpoint gives
it back bit for bit. training.json lists the snapshots averaged (path, SHA-256 of the weights, and
each one's own training.json).
"""

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from loading.checkpoint import build_model, load_config, save_checkpoint
from loading.tokenizer import Tokenizer
from training.data import file_sha256


def average_checkpoints(snapshots: list[Path], out: Path, command: str) -> None:
    """Writes the mean of the snapshots' weights to out; ValueError if their configs or tokenizers differ."""
    if not snapshots:
        raise ValueError("no snapshots to average")
    config = load_config(snapshots[0])
    tokenizer_bytes = (snapshots[0] / "tokenizer.model").read_bytes()
    for snapshot in snapshots[1:]:
        if load_config(snapshot) != config:
            raise ValueError(f"{snapshot}/config.json differs from {snapshots[0]}/config.json")
        if (snapshot / "tokenizer.model").read_bytes() != tokenizer_bytes:
            raise ValueError(f"{snapshot}/tokenizer.model differs from {snapshots[0]}/tokenizer.model")
    total: dict[str, torch.Tensor] = {}
    dtypes: set[torch.dtype] = set()
    for snapshot in snapshots:
        state = load_file(str(snapshot / "model.safetensors"))
        if total and state.keys() != total.keys():
            raise ValueError(f"{snapshot} holds other tensors than {snapshots[0]}")
        for name, tensor in state.items():
            dtypes.add(tensor.dtype)
            total[name] = total[name] + tensor.float() if name in total else tensor.float()
    model = build_model(config)
    model.load_state_dict({name: t / len(snapshots) for name, t in total.items()})
    averaged: list[dict[str, Any]] = [
        {
            "path": str(s),
            "model_sha256": file_sha256(s / "model.safetensors"),
            "training": json.loads((s / "training.json").read_text()),
        }
        for s in snapshots
    ]
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    training = {"command": command, "averaged": averaged, "stored_dtype": str(dtype).removeprefix("torch.")}
    save_checkpoint(out, model, Tokenizer(tokenizer_bytes), training, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("snapshots", nargs="+", type=Path, help="checkpoint folders to average")
    args = parser.parse_args()
    command = "python -m training.average " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    average_checkpoints(args.snapshots, args.out, command)
    print(f"{args.out}: mean of {len(args.snapshots)} snapshots")


if __name__ == "__main__":
    main()
