"""The tutorials' pronoun example on the shipped generator: where "it" looks in "The animal
didn't cross the street because it was too tired" and "... too wide".

    python -m training.pronoun_attention --out docs/pronoun_attention.png

Prints, per sentence, the attention to "animal" and to "street" (each layer, averaged over
heads) from "it" and from the closing "." and draws it for every earlier token. The generator is
causal: "it" cannot see "tired" or "wide", so its attention is the same in both sentences by
construction; only a later token (the closing ".") can tell them apart.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loading.checkpoint import DEFAULT_GENERATOR, load_checkpoint
from model.attention_maps import self_attention
from model.generator import Generator

SENTENCES = [
    "The animal didn't cross the street because it was too tired.",
    "The animal didn't cross the street because it was too wide.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_GENERATOR)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model, tokenizer = load_checkpoint(args.checkpoint)
    assert isinstance(model, Generator)
    figure, axes = plt.subplots(len(SENTENCES), 2, figsize=(15, 3.4 * len(SENTENCES)), squeeze=False)
    for row_axes, sentence in zip(axes, SENTENCES, strict=True):
        ids = tokenizer.encode(sentence)
        tokens = [tokenizer.piece_bytes(i).decode("utf-8", errors="replace") for i in ids]
        maps = self_attention(model, ids).mean(dim=1)  # (layers, T, T), heads averaged
        for ax, (name, query) in zip(row_axes, [("it", tokens.index(" it")), ("the closing .", len(tokens) - 1)], strict=True):
            weights = maps[:, query, : query + 1]  # (layers, tokens up to the query)
            report = {word: [round(float(w), 3) for w in weights[:, tokens.index(word)]] for word in (" an", " stre")}
            print(json.dumps({"sentence": sentence, "from": name, "to animal / street by layer": report}))
            for layer, row in enumerate(weights):
                ax.plot(range(query + 1), row.tolist(), marker="o", label=f"layer {layer + 1}")
            ax.set_xticks(range(query + 1), [t.replace(" ", "\u2423") for t in tokens[: query + 1]], rotation=60, fontsize=8)
            ax.set_title(f"from \u201c{name}\u201d: {sentence}", fontsize=9)
            ax.set_ylabel("weight (heads averaged)")
    axes[0, 0].legend(ncol=3, fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
