"""Seconds per training step of a model preset on this machine: torch threads 1 and 2, float32 and
bf16 autocast, side by side in one run, so a training run's steps can be planned from them.

    python -m benchmarks.training_speed [--model generator|translator] [--batch-size 32] [--steps 6] [--json FILE]

Each setting times --steps steps of the preset (shakespeare-small / multi30k-small) on random
tokens (a generator batch of --batch-size windows of the model's context; a translator batch of
--batch-size pairs of 24 source and 26 target tokens) with the trainer's own optimizer, and keeps
the median after the first step. Settings take turns, round by round, so drift on a shared
machine falls on all of them. Nothing else should run meanwhile.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.provenance import commit, machine
from loading.checkpoint import build_model
from model.config import GeneratorConfig, ModelConfig, TranslatorConfig
from model.translator import Translator

SETTINGS = [(1, False), (1, True), (2, False), (2, True)]  # (threads, bf16 autocast)


def training_step(model_name: str, batch_size: int) -> tuple[Callable[[bool], None], int]:
    """A closure running one optimizer step (bf16 autocast or not) of a fresh preset model, and the tokens in its batch."""
    torch.manual_seed(0)
    config: ModelConfig
    tokens: list[torch.Tensor]
    if model_name == "generator":
        config = GeneratorConfig.preset("shakespeare-small")
        tokens = [torch.randint(4, config.vocab_size, (batch_size, config.max_len + 1))]
    else:
        config = TranslatorConfig.preset("multi30k-small")
        tokens = [torch.randint(4, config.vocab_size, (batch_size, 24)), torch.randint(4, config.vocab_size, (batch_size, 27))]
    model = build_model(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), weight_decay=0.1)

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if isinstance(model, Translator):
                src, tgt = tokens[0], tokens[1]
                logits = model(src, tgt[:, :-1])  # (B, T, V)
                target = tgt[:, 1:]
            else:
                logits = model(tokens[0][:, :-1])  # (B, T, V)
                target = tokens[0][:, 1:]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step, sum(t[:, 1:].numel() for t in tokens[-1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["generator", "translator"], default="generator")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    step, tokens = training_step(args.model, args.batch_size)
    seconds: dict[tuple[int, bool], list[float]] = {setting: [] for setting in SETTINGS}
    for round_ in range(args.steps):
        for threads, bf16 in SETTINGS:
            torch.set_num_threads(threads)
            started = time.perf_counter()
            step(bf16)
            if round_:  # the first step of each setting warms its kernels up
                seconds[(threads, bf16)].append(time.perf_counter() - started)
    rows = []
    baseline = statistics.median(seconds[(1, False)])
    for (threads, bf16), times in seconds.items():
        median = statistics.median(times)
        rows.append(
            {
                "threads": threads,
                "bf16_autocast": bf16,
                "seconds_per_step": round(median, 4),
                "target_tokens_per_s": round(tokens / median),
                "speedup_vs_1_thread_float32": round(baseline / median, 2),
            }
        )
        print(
            f"threads {threads} {'bf16   ' if bf16 else 'float32'}: {median:.3f} s/step,"
            f" {tokens / median:,.0f} tokens/s, x{baseline / median:.2f}"
        )
    result = {"model": args.model, "batch_size": args.batch_size, "machine": machine(), "commit": commit(), "settings": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
