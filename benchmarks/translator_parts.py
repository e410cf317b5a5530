"""Each part of the translator's step against the path it replaced, measured alone, side by side.

    python -m benchmarks.translator_parts [--translator DIR] [--sentences 1000] [--repeats 3]
                                          [--threads 1] [--json] [--quick]

The engine translates the Multi30k test sentences as `benchmarks.peers` has it do (every request at
once, 64 x beam slots, greedy and beam 4), with every part on and with one part off at a time,
the runs taking turns (the best of --repeats each):
- ragged_encode: a step's new sources encoded side by side, no padding computed (off: padded to
  the longest of them; TranslatorRunner.ragged_encode);
- source_kernel: a decoder step's cross-attention reads each row's source keys in place through
  the CPU decode kernel (off: SDPA over views of the cross-attention cache, a sentence's beams
  together; CrossAttentionCache.decode_kernel);
- top_k_kernel: greedy ids, and each beam's 2K best tokens with its log-sum-exp, in one pass of the
  row top-k kernel (off: torch's argmax, top-k and logsumexp; decoding/top_k_cpu.py).
Prints sentences/s and each part's speed-up (all on / that part off), and whether the translations
are the same; with --json the last line is one JSON object (<work>_<part>_speedup, ...). --quick
(16 sentences, one repeat) checks the script.
"""

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import torch

from benchmarks.peers import checked, engine_translate, multi30k_test_set, offline_engine
from benchmarks.provenance import commit
from decoding import top_k_cpu
from loading.checkpoint import DEFAULT_TRANSLATOR
from service.engine.engine import Engine
from service.engine.runner import TranslatorRunner

PARTS = ("ragged_encode", "source_kernel", "top_k_kernel")


@contextmanager
def without(engine: Engine, part: str) -> Iterator[None]:
    """The engine with `part` off, for the block."""
    runner = engine.runner
    assert isinstance(runner, TranslatorRunner)
    if part == "top_k_kernel":
        with mock.patch.object(top_k_cpu, "kernel", lambda: None):
            yield
        return
    owner = runner if part == "ragged_encode" else runner.cross_cache
    attribute = part if part == "ragged_encode" else "decode_kernel"
    was = getattr(owner, attribute)
    assert was, f"{part} is off already (no C compiler, or ALiBi positions)"
    setattr(owner, attribute, False)
    try:
        yield
    finally:
        setattr(owner, attribute, was)


def measure(engine: Engine, sentences: list[str], beam: int, repeats: int) -> dict[str, tuple[float, list[str]]]:
    """Best seconds and the translations with everything on ("all") and with each part off."""
    best: dict[str, tuple[float, list[str]]] = {}
    engine_translate(engine, sentences[:64], beam)  # warm-up
    for _ in range(repeats):
        for name in ("all", *PARTS):
            with nullcontext() if name == "all" else without(engine, name):
                started = time.perf_counter()
                outputs = engine_translate(engine, sentences, beam)
                seconds = time.perf_counter() - started
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, outputs)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--translator", type=Path, default=DEFAULT_TRANSLATOR)
    parser.add_argument("--sentences", type=int, default=1000, help="the first N test sentences")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="16 sentences, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.sentences, args.repeats = 16, 1
    torch.set_num_threads(args.threads)
    sentences = multi30k_test_set(args.translator, checked(args.translator, "translator"))[0][: args.sentences]
    figures: dict[str, object] = {"commit": commit(), "sentences": len(sentences), "threads": args.threads}
    print(f"{'work':16} {'part off':14} {'sentences/s':>12} {'speed-up':>9} {'same':>6}")
    for work, beam in (("translate_greedy", 1), ("translate_beam4", 4)):
        best = measure(offline_engine(args.translator, 64 * beam), sentences, beam, args.repeats)
        seconds, outputs = best["all"]
        figures[f"{work}_sentences_per_s"] = round(len(sentences) / seconds, 1)
        print(f"{work:16} {'(none)':14} {len(sentences) / seconds:>12.1f}")
        for part in PARTS:
            off_seconds, off_outputs = best[part]
            same = sum(a == b for a, b in zip(outputs, off_outputs, strict=True)) / len(sentences)
            figures |= {f"{work}_{part}_speedup": round(off_seconds / seconds, 3), f"{work}_{part}_same": same}
            print(f"{work:16} {part:14} {len(sentences) / off_seconds:>12.1f} {off_seconds / seconds:>9.3f} {same:>6.3f}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
