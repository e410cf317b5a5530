"""Peak memory of loading a Hugging Face folder, against the loaded model's own bytes.

    python -m benchmarks.load_memory [FOLDER] [--dtype bfloat16]

Without FOLDER, builds once into runs/load_memory/ a bf16 LlamaForCausalLM of 83M parameters with
random weights (166 MB: 16 layers, hidden 512, 8 heads over 4 key/value heads, 32,000 ids, untied;
tests/hf_folders.py's tokenizer). A fresh process loads it on the CPU (loading.checkpoint's
load_checkpoint, in --dtype): the peak is its largest resident set while loading (Linux's VmHWM,
reset just before) less its resident set just before, and the ratio that peak over the bytes of the
model's parameters and buffers. Prints one JSON object.
"""

import argparse
import importlib
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FOLDER = ROOT / "runs" / "load_memory" / "llama-83m-bf16"
SHAPE: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def build_folder(path: Path) -> Path:
    """A bf16 LlamaForCausalLM of SHAPE with random weights and the tests' tokenizer; kept if path exists."""
    if path.is_dir():
        return path
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    # By name: mypy checks benchmarks/, not the tests' helpers.
    folders = importlib.import_module("tests.hf_folders")
    partial = path.with_name(path.name + ".partial")
    folders.build_llama_folder(partial)  # the tokenizer and chat template; its small model is replaced below
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, bos_token_id=folders.BOS, eos_token_id=folders.EOS, pad_token_id=folders.EOS)
    model = LlamaForCausalLM(config).bfloat16()
    model.generation_config = GenerationConfig(bos_token_id=folders.BOS, eos_token_id=[folders.EOS, folders.EOT], pad_token_id=folders.EOS)
    model.save_pretrained(str(partial))
    partial.rename(path)
    return path


def _status_bytes(key: str) -> int:
    """A size from /proc/self/status (VmRSS: the resident set now; VmHWM: its peak)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024  # kB


def load_and_measure(folder: Path, dtype: str) -> dict[str, Any]:
    """Loads folder in this process (which should have loaded nothing else) and measures the peak.
    Not ru_maxrss: a child's counts the parent's resident set it was forked with."""
    import torch

    from loading.checkpoint import load_checkpoint

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the resident set now
    before = _status_bytes("VmRSS")
    model, _ = load_checkpoint(folder, "cpu", getattr(torch, dtype))
    peak = _status_bytes("VmHWM") - before
    own = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    return {"folder": str(folder), "dtype": dtype, "model_bytes": own, "peak_bytes": peak, "ratio": round(peak / own, 3)}


def measure(folder: Path, dtype: str = "bfloat16") -> dict[str, Any]:
    """load_and_measure in a fresh process."""
    command = [sys.executable, "-m", "benchmarks.load_memory", str(folder), "--dtype", dtype, "--here"]
    out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, nargs="?", default=None, help=f"a Hugging Face folder (default: built into {DEFAULT_FOLDER})")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--here", action="store_true", help="load in this process (what the fresh process runs)")
    args = parser.parse_args()
    if args.here:
        print(json.dumps(load_and_measure(args.folder, args.dtype)))
    else:
        print(json.dumps(measure(args.folder or build_folder(DEFAULT_FOLDER), args.dtype), indent=1))


if __name__ == "__main__":
    main()
