"""Plots the validation curves of a checkpoint's lineage: its original run, then the run continued from it.

    python -m training.training_curves --out docs/training_curves.png \\
        --translator ORIGINAL/training.json CONTINUED/training.json \\
        --generator ORIGINAL/training.json CONTINUED/training.json
    python -m training.training_curves --out docs/generator_halves.png \\
        --halves RUN/training.json --references benchmarks/results/generator_training.json

Top: the whole lineage, x in training minutes since the first run began (each run on its own
clock, so a run on other hardware keeps its own pace). Bottom: the continued runs alone. y is the
validation score each run selected by (greedy BLEU on val, or nats per character).

--halves plots a generator run's two halves of the whole-play validation against its steps, with
the scores of the other checkpoints of a `training.evaluate generator-validation --json` file as
horizontal lines.
"""

import argparse
import json
from pathlib import Path
from typing import Any


def describe(training: dict[str, Any]) -> str:
    return f"{training['device']}, {training['steps']:,} steps"


def plot(full: Any, zoom: Any, runs: list[Path], title: str, ylabel: str) -> None:
    """Each run's validation history on full, a continued run starting where its parent ended; zoom
    shows the continued runs on their own clock beside the original's final score."""
    offset = 0.0
    for i, path in enumerate(runs):
        training = json.loads(path.read_text())
        history = training["validation_history"]
        minutes = [h["minutes"] for h in history]
        scores = [h["val"] for h in history]
        label = ("original" if i == 0 else "continued (--init-from)") + f": {describe(training)}"
        full.plot([offset + m for m in minutes], scores, marker="o", markersize=3, label=label, color=f"C{i}")
        if i:
            full.axvline(offset, color="grey", linestyle=":", linewidth=1)
            zoom.plot(minutes, scores, marker="o", markersize=3, label=label, color=f"C{i}")
        else:
            zoom.axhline(scores[-1], color="C0", linestyle="--", linewidth=1, label=f"original's final score {scores[-1]:.4g}")
        offset += minutes[-1]
    for ax, subtitle, xlabel in ((full, "", "training minutes since the first run"), (zoom, ", continued run", "training minutes")):
        ax.set_title(title + subtitle)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def plot_halves(axes: Any, run: Path, references: Path) -> None:
    """The run's half A and half B scores by step, one half per axis, each with the other
    checkpoints' scores of `references` (the run's own row left out) as dashed lines."""
    training = json.loads(run.read_text())
    history = training["validation_history"]
    others = [r for r in json.loads(references.read_text())["checkpoints"] if Path(r["checkpoint"]) != run.parent]
    for ax, half in zip(axes, ("A", "B"), strict=True):
        ax.plot(
            [h["step"] for h in history],
            [h[f"val_{half}"] for h in history],
            marker="o",
            markersize=3,
            color="C0",
            label=f"this run: {describe(training)}",
        )
        for i, row in enumerate(others, start=1):
            ax.axhline(row[half], color=f"C{i}", linestyle="--", linewidth=1, label=f"{row['checkpoint']}: {row[half]:.4f}")
        ax.set_title(f"half {half} of the held-out plays")
        ax.set_xlabel("step")
        ax.set_ylabel("nats per character (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--translator", nargs="+", type=Path, help="training.json files, oldest first")
    parser.add_argument("--generator", nargs="+", type=Path, help="training.json files, oldest first")
    parser.add_argument("--halves", type=Path, help="a generator run's training.json (instead of --translator and --generator)")
    parser.add_argument("--references", type=Path, help="with --halves: a generator-validation --json file")
    args = parser.parse_args()
    if not (args.halves and args.references) and not (args.translator and args.generator):
        parser.error("give --translator and --generator, or --halves and --references")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.halves:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        plot_halves(axes, args.halves, args.references)
    else:
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        plot(axes[0][0], axes[1][0], args.translator, "translator (Multi30k val)", "greedy sacreBLEU (higher is better)")
        plot(axes[0][1], axes[1][1], args.generator, "generator (last 10% of train.txt)", "nats per character (lower is better)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
