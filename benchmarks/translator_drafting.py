"""What n-gram drafting could save the translator: decoder steps of greedy translation with the
engine's own proposers, counted over the translator's own outputs.

    python -m benchmarks.translator_drafting [--translator DIR] [--sentences 1000] [--json] [--quick]

The engine translates the Multi30k test sentences greedily (every request at once, as
`benchmarks.peers` has it); then, sentence after sentence in the test set's order, the
proposers a decoder-only request drafts with (service/engine/speculation.py: PromptLookup over
the request's context, RecentOutputs over the answers before it, the engine's defaults for n and
the number of proposed tokens) propose at each step of that translation, and the step keeps the
proposals the output goes on with, plus one token. Prints tokens a step with the context
the output alone, with the source before it (the proposer reads both: proposing from the source),
and each with the recent outputs. Tokens a step is the most drafting can speed up greedy
decoding, with verification free; a step that verifies k + 1 tokens a row costs more than one
that decodes one. No timing: the figures are the same on every machine. --quick: 16 sentences.
"""

import argparse
import json
from pathlib import Path

import torch

from benchmarks.peers import checked, multi30k_test_set
from benchmarks.provenance import commit
from loading.checkpoint import DEFAULT_TRANSLATOR, load_checkpoint
from model.translator import Translator
from service.engine.config import EngineConfig
from service.engine.offline import OfflineEngine
from service.engine.runner import prompt_ids
from service.engine.speculation import PromptLookup, RecentOutputs


def decoder_steps(outputs: list[list[int]], sources: list[list[int]] | None, recent: RecentOutputs | None, config: EngineConfig) -> int:
    """Decoder steps of every output (its eos included), in order, drafting as the engine drafts:
    each step keeps the proposals the output goes on with, and one token more."""
    steps = 0
    for i, target in enumerate(outputs):
        source = sources[i] if sources is not None else []
        lookup = PromptLookup(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
        made = 0
        while made < len(target):
            context = source + target[:made]
            proposal = lookup.propose(context, recent) if context else []
            taken = 0
            while taken < len(proposal) and made + taken < len(target) and proposal[taken] == target[made + taken]:
                taken += 1
            if proposal:
                lookup.accepted(len(proposal), taken)
            made += taken + 1
            steps += 1
        if recent is not None:
            recent.add(target)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--translator", type=Path, default=DEFAULT_TRANSLATOR)
    parser.add_argument("--sentences", type=int, default=1000, help="the first N test sentences")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="16 sentences")
    args = parser.parse_args()
    sentences = multi30k_test_set(args.translator, checked(args.translator, "translator"))[0][: 16 if args.quick else args.sentences]
    model, tokenizer = load_checkpoint(args.translator, "cpu", torch.float32)
    assert isinstance(model, Translator)
    eos = model.config.eos_id
    outputs = [c.token_ids + [eos] for c in OfflineEngine(model, tokenizer).generate(sentences)]
    sources = [prompt_ids(tokenizer, s, None, eos) for s in sentences]
    config = EngineConfig()
    tokens = sum(len(o) for o in outputs)
    figures: dict[str, object] = {"commit": commit(), "sentences": len(sentences), "tokens": tokens, "k": config.num_speculative_tokens}
    print(f"{'context':22} {'recent outputs':>15} {'steps':>7} {'tokens a step':>14}")
    for context, with_sources in (("output", None), ("source_and_output", sources)):
        for with_recent in (False, True):
            n, most = (config.prompt_lookup_min, config.prompt_lookup_max), config.recent_outputs_tokens
            recent = RecentOutputs(*n, most) if with_recent else None
            steps = decoder_steps(outputs, with_sources, recent, config)
            name = f"{context}{'_and_recent' if with_recent else ''}"
            figures[f"{name}_tokens_per_step"] = round(tokens / steps, 3)
            print(f"{context:22} {'yes' if with_recent else 'no':>15} {steps:>7} {tokens / steps:>14.3f}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
