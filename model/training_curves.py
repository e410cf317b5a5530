"""Plots the validation curves of a checkpoint's lineage: its original run, then the run continued from it.

    python -m model.training_curves --out docs/training_curves.png \\
        --translator ORIGINAL/training.json CONTINUED/training.json \\
        --generator ORIGINAL/training.json CONTINUED/training.json

x is training minutes since the lineage began (each run's own clock, so a run on other hardware
keeps its own pace); y is each run's validation score (greedy BLEU on val, or nats per character).
"""

import argparse
import json
from pathlib import Path
from typing import Any


def describe(training: dict[str, Any]) -> str:
    return f"{training['device']}, {training['steps']:,} steps"


def plot(ax: Any, runs: list[Path], title: str, ylabel: str) -> None:
    """Each run's validation history on ax, a continued run starting where its parent ended."""
    offset = 0.0
    for i, path in enumerate(runs):
        training = json.loads(path.read_text())
        history = training["validation_history"]
        minutes = [offset + h["minutes"] for h in history]
        label = ("original" if i == 0 else "continued (--init-from)") + f": {describe(training)}"
        ax.plot(minutes, [h["val"] for h in history], marker="o", markersize=3, label=label)
        if i:
            ax.axvline(offset, color="grey", linestyle=":", linewidth=1)
        offset = minutes[-1]
    ax.set_title(title)
    ax.set_xlabel("training minutes")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--translator", nargs="+", required=True, type=Path, help="training.json files, oldest first")
    parser.add_argument("--generator", nargs="+", required=True, type=Path, help="training.json files, oldest first")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    plot(left, args.translator, "translator (Multi30k val)", "greedy sacreBLEU (higher is better)")
    plot(right, args.generator, "generator (last 10% of train.txt)", "nats per character (lower is better)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
