"""Stores a trained checkpoint in 16-bit floats for the repository.

    python -m exports.ship runs/translator/best model/checkpoints/translator-en-de

Weights are loaded back as float32; check the scores with `python -m training.evaluate` after shipping.
"""

import argparse
import json
from pathlib import Path

import torch

from loading.checkpoint import load_native_checkpoint, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("destination", type=Path)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args()
    model, tokenizer = load_native_checkpoint(args.source)
    training = json.loads((args.source / "training.json").read_text())
    training["stored_dtype"] = args.dtype
    save_checkpoint(args.destination, model, tokenizer, training, dtype=getattr(torch, args.dtype))
    size = sum(f.stat().st_size for f in args.destination.iterdir())
    print(f"{args.destination}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
