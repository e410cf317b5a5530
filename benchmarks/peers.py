"""Our engine against transformers and CTranslate2 on the same work, side by side in one run.

    python -m benchmarks.peers [--translator DIR] [--generator DIR] [--json] [--out DIR]
                               [--threads 1] [--repeats 2] [--quick]

--translator and --generator (default: the shipped checkpoints) each take our checkpoint folder or
a Hugging Face one (MarianMTModel; GPTNeoXForCausalLM or the Llama family; loading/folder.py tells
which). Our engine loads the folder itself (Engine.from_checkpoint). For our folders the peers run
exact exports made into a temporary folder (exports/export.py); a Hugging Face folder transformers
loads as it is and CTranslate2 gets through its TransformersConverter (its Marian converter starts
the decoder from a zero embedding, as Marian's own models do). Every system in float32; CTranslate2 int8 is
its float32 model quantised at load. Same threads (torch intra-op threads for ours and
transformers, ctranslate2's intra_threads), same inputs, same batch sizes; each timer covers
tokenization, generation and detokenization. After one untimed warm-up each, the systems take
turns for --repeats timed runs and each keeps its best wall time and its least CPU time (the
machine is shared: a busy spell then falls on every system; cpu_seconds_per_second, near 1 with
one thread on an idle machine, tells how busy it was, and the _by_cpu ratios, from CPU time,
move least with it).

- translate_greedy / translate_beam4: the 1,000 test_2016_flickr sentences of Multi30k in the
  translator's source language (references in its target language; en, de, fr and cs exist),
  64 sentences in flight for every system. transformers and CTranslate2 get them sorted by
  length in batches of 64; our engine takes all the requests at once (the service's path:
  Engine.from_checkpoint, add_request, step until done) with 64 x beam_size slots and batches
  continuously. Output limits are the service's (twice the source plus ten tokens, within the
  context the engine serves: the model's positions, at most service.engine.config's
  DEFAULT_MAX_CONTEXT): ours per sentence, the peers' per batch (the longest sentence's), so a
  sentence that runs into its limit can go on longer there. Beam 4: length penalty 1.0,
  stopping when 4 hypotheses have ended (transformers' early_stopping=True). BLEU: sacreBLEU
  corpus_bleu, 13a, cased.
- generate_batch_1 / generate_batch_16: the generator, greedy, at most 200 new tokens for every
  prompt, each system ending a prompt at the model's end-of-sequence ids (ours: the folder's, the
  peers given the same). Each system's throughput counts the tokens it generated (the
  end-of-sequence token that ended a text not counted): <work>_tokens_<system>, equal for systems
  that agree. The shipped generator runs all 200 on every prompt. Batch 1 runs 4 prompts one
  after another, batch 16 sixteen prompts at once (our engine: 16 slots).

Tokens for CTranslate2: for our folders, pieces of our sentencepiece model (ctranslate2 appends
a source's </s>); for a Hugging Face folder, its tokenizer's tokens (MarianTokenizer appends the
</s>), output tokens back to text with the same tokenizer, special tokens dropped.

Prints a table; with --json the last line is one JSON object: each figure, the ratios
<work>_vs_<peer> (ours / peer, throughput; <work>_vs_<peer>_by_cpu from the work per CPU second),
the same for our int8 weights (<work>_int8_vs_<peer>, "ours_int8": model/quantize.py), for
ours with the compiled decode step (<work>_compiled_vs_<peer>, "ours_compiled":
service/engine/compiled_decode.py, the service's default step, compiled at every row count a step
decodes: in translation every row count up to the slots, 8 with --quick; in generation up to the
engine's max_decode_rows, a verification of drafts computing a row per token, at most 64 as the
service compiles; its start, compiling and timing one size per power-of-two bucket, is
<work>_start_seconds_ours_compiled) and for both (<work>_int8_compiled_vs_<peer>,
"ours_int8_compiled"), the BLEU of
each system and the share of each other system's outputs equal to ours (<work>_same_as_ours_<system>);
"models" names the folders compared (path, kind ours / hugging_face, context, languages).
Writes peers.json and peers.png into --out: by default benchmarks/results for the shipped
checkpoints (the figures the docs show, python -m benchmarks.report), and
benchmarks/results/peers-<translator folder name>+<generator folder name> when either folder is
another, so that a run on other models never replaces them. --quick (100 sentences, 2 prompts at
batch 1, one repeat, a translator's step compiled at up to 8 rows) checks the script; its files
go to a temporary folder unless --out says where.
"""

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

import ctranslate2
import sacrebleu
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GPTNeoXForCausalLM,
    MarianMTModel,
    PreTrainedTokenizerBase,
)

from benchmarks.provenance import commit, machine
from decoding.sampling_params import GREEDY
from decoding.translate import max_new_tokens_for
from exports.export import export_ct2, export_hf
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, WeightType, load_config
from loading.folder import CheckpointError, FolderInfo, ModelKind, inspect_folder, read_json
from loading.tokenizer import Tokenizer
from service.engine.config import DEFAULT_COMPILED_DECODE, EngineConfig, serving_context
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from training.data import SHARED_DATA, read_lines

SYSTEMS = ["ours", "ours_int8", "transformers", "ct2_float32", "ct2_int8"]
PEERS = SYSTEMS[2:]
COMPILED = "ours_compiled"  # ours with the compiled decode step (EngineConfig.compiled_decode)
COMPILED_INT8 = "ours_int8_compiled"  # int8 weights with the compiled decode step: the service's default step
QUICK_COMPILED_ROWS = 8  # --quick: a translator's compiled step at these row counts only (each is timed at start)
BATCH_SENTENCES = 64
NEW_TOKENS = 200
ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks/results")
QUICK_RESULTS = Path(tempfile.gettempdir()) / "benchmarks-quick"
MULTI30K = SHARED_DATA / "multi30k"

# At least two tokens each: CTranslate2 4.8.5, given a batch whose shortest prompt is one token,
# returns the other prompts' tails in the output (include_prompt_in_result=False) and counts
# them in max_length.
PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY:\nNow", "To be", "JULIET:\nO", "MENENIUS:\n", "The king", "HAMLET:\n"]

Outputs = list[str]  # translations
Generated = tuple[str, int]  # a generated text and its tokens (not the end-of-sequence token that ended it)
Output = TypeVar("Output")
Encode = Callable[[list[str]], list[list[str]]]  # texts to the tokens ctranslate2 takes
Decode = Callable[[list[str]], str]  # ctranslate2's output tokens to text


@dataclass(frozen=True)
class Compared:
    """One model under comparison: the folder our engine loads, whether it is a Hugging Face one,
    the folder transformers loads (that folder, or our export of it), its CTranslate2 model
    (float32), and the context our engine serves for it (prompt + output, or source / output)."""

    folder: Path
    hugging_face: bool
    hf: Path
    ct2: Path
    max_len: int

    def describe(self, info: FolderInfo) -> dict[str, Any]:
        path = self.folder.resolve()
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        languages = {"source_lang": info.source_lang, "target_lang": info.target_lang} if info.kind == "translator" else {}
        return {"path": str(shown), "kind": "hugging_face" if self.hugging_face else "ours", "max_len": self.max_len, **languages}


@dataclass
class Measured(Generic[Output]):
    outputs: list[Output]
    seconds: float  # the best wall time
    cpu_seconds: float  # the least CPU time of the process (all its threads): what other processes on the machine change least


class Converter(ctranslate2.converters.TransformersConverter):  # type: ignore[misc]  # untyped
    """ctranslate2's TransformersConverter, given the transformers 4 names its GPT-NeoX loader
    reads: config.rotary_pct (transformers 5: rope_parameters' partial_rotary_factor; the loader
    takes no rotary base but 10000) and embed_out (transformers 5: lm_head)."""

    def load_model(self, model_class: Any, model_name_or_path: str, **kwargs: Any) -> Any:
        model = super().load_model(model_class, model_name_or_path, **kwargs)
        rope = getattr(model.config, "rope_parameters", None) or {}
        if "partial_rotary_factor" in rope and not hasattr(model.config, "rotary_pct"):
            if rope.get("rope_theta", 10000) != 10000:
                raise ValueError(f"rope_theta {rope['rope_theta']}: CTranslate2's GPT-NeoX converter takes 10000 only")
            model.config.rotary_pct = rope["partial_rotary_factor"]
        if hasattr(model, "lm_head") and not hasattr(model, "embed_out"):
            model.embed_out = model.lm_head
        return model


def prepare(folder: Path, hugging_face: bool, into: Path) -> Compared:
    """The peers' copies of folder, made in into (which must not exist): our folder exported
    (export_hf, export_ct2), a Hugging Face one converted for CTranslate2 (TransformersConverter)."""
    ct2 = into / "ct2"
    if hugging_face:
        try:
            Converter(str(folder)).convert(str(ct2), quantization="float32")
        except ValueError as error:  # e.g. its Marian converter drops the last id, which must be <pad> (as in opus-mt)
            raise SystemExit(f"peers: CTranslate2's TransformersConverter cannot convert {folder}: {error}") from None
        positions = int(AutoConfig.from_pretrained(folder).max_position_embeddings)
        return Compared(folder, True, folder, ct2, serving_context(None, positions))
    export_hf(folder, into / "hf")
    export_ct2(folder, ct2)
    return Compared(folder, False, into / "hf", ct2, serving_context(None, load_config(folder).max_len))


def ct2_tokens(model: Compared, hf_tokenizer: PreTrainedTokenizerBase) -> tuple[Encode, Decode]:
    """How CTranslate2 reads and writes the model's text: our sentencepiece pieces for our folders
    (ctranslate2 appends a source's </s>), the folder's tokenizer's tokens for a Hugging Face one
    (MarianTokenizer appends </s>); output tokens to text without special tokens."""
    if model.hugging_face:

        def encode_hf(texts: list[str]) -> list[list[str]]:
            return [[*hf_tokenizer.convert_ids_to_tokens(ids)] for ids in hf_tokenizer(texts)["input_ids"]]  # ids in, a list out

        def decode_hf(tokens: list[str]) -> str:
            # A token of a model row past the tokenizer's ids (padded vocabularies, as Pythia's) has
            # no id there: it decodes to nothing, as its id does through transformers.
            ids = hf_tokenizer.convert_tokens_to_ids(tokens)
            assert isinstance(ids, list)  # a list in, a list out
            return str(hf_tokenizer.decode([i for i in ids if i is not None], skip_special_tokens=True))

        return encode_hf, decode_hf
    tokenizer = Tokenizer.load(model.folder / "tokenizer.model")

    def encode(texts: list[str]) -> list[list[str]]:
        pieces: list[list[str]] = tokenizer.sp.encode(texts, out_type=str)
        return pieces

    def decode(tokens: list[str]) -> str:
        return tokenizer.decode([tokenizer.sp.piece_to_id(piece) for piece in tokens])

    return encode, decode


def measure(
    runs: dict[str, Callable[[list[str]], list[Output]]], inputs: list[list[str]], warm_up: list[str], repeats: int
) -> dict[str, Measured[Output]]:
    """Each system's outputs for the batches of inputs (one call each) and its best times over
    repeats, the systems taking turns so that a busy spell of the machine falls on all of them.
    Each system first makes one untimed call on warm_up."""
    for run in runs.values():
        run(warm_up)
    best: dict[str, Measured[Output]] = {}
    for _ in range(repeats):
        for system, run in runs.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            outputs = [text for batch in inputs for text in run(batch)]
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
            if system in best:
                seconds, cpu_seconds = min(seconds, best[system].seconds), min(cpu_seconds, best[system].cpu_seconds)
            best[system] = Measured(outputs, seconds, cpu_seconds)
    return best


def length_batches(sequences: Sequence[Sized], size: int) -> list[list[int]]:
    """Indices of the sequences sorted by length, in batches of size (what offline translators do)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]


def offline_engine(checkpoint: Path, n_slots: int, weights: WeightType = torch.float32, compiled_decode: tuple[int, ...] = ()) -> Engine:
    """The service's engine for an offline batch: every request waits its turn (no deadlines)."""
    config = EngineConfig(
        n_slots=n_slots, max_waiting=10_000, queue_timeout_s=None, request_timeout_s=None, compiled_decode=compiled_decode
    )
    return Engine.from_checkpoint(checkpoint, config, "cpu", weights)


def engine_translate(engine: Engine, sentences: list[str], beam_size: int) -> Outputs:
    params = GenerationParams(sampling=GREEDY) if beam_size == 1 else GenerationParams(beam_size=beam_size, length_penalty=1.0)
    for i, sentence in enumerate(sentences):
        engine.add_request(Request(f"t{i}", engine.runner.encode_prompt(sentence), params))
    texts = [""] * len(sentences)
    while engine.has_work:
        for delta in engine.step().deltas:
            texts[int(delta.request_id[1:])] += delta.text
            assert delta.finish_reason in (None, "stop", "length"), delta
    return texts


def transformers_translate(
    model: MarianMTModel, tokenizer: PreTrainedTokenizerBase, sentences: list[str], beam_size: int, max_len: int
) -> Outputs:
    ids: list[list[int]] = tokenizer(sentences)["input_ids"]  # MarianTokenizer appends </s>
    beam: dict[str, Any] = {"num_beams": beam_size, "length_penalty": 1.0, "early_stopping": True} if beam_size > 1 else {}
    texts = [""] * len(sentences)
    for batch in length_batches(ids, BATCH_SENTENCES):
        width = max(len(ids[i]) for i in batch)
        src = torch.tensor([ids[i] + [tokenizer.pad_token_id] * (width - len(ids[i])) for i in batch])  # (B, S)
        mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in batch])
        limit = max(max_new_tokens_for(len(ids[i]), max_len) for i in batch)
        with torch.inference_mode():
            out = model.generate(  # type: ignore[misc]  # transformers types generate() with two selves
                input_ids=src,
                attention_mask=mask,
                max_length=limit + 1,  # + the decoder's start token
                do_sample=False,
                **beam,
            )
        assert isinstance(out, torch.Tensor)
        for i, text in zip(batch, tokenizer.batch_decode(out, skip_special_tokens=True), strict=True):
            texts[i] = text
    return texts


def ct2_translate(
    translator: ctranslate2.Translator, encode: Encode, decode: Decode, sentences: list[str], beam_size: int, max_len: int, adds_eos: bool
) -> Outputs:
    """adds_eos: ctranslate2 appends </s> to each source (the model's add_source_eos)."""
    tokens = encode(sentences)
    texts = [""] * len(sentences)
    for batch in length_batches(tokens, BATCH_SENTENCES):
        limit = max(max_new_tokens_for(len(tokens[i]) + adds_eos, max_len) for i in batch)
        results = translator.translate_batch(
            [tokens[i] for i in batch], beam_size=beam_size, length_penalty=1.0, max_decoding_length=limit, min_decoding_length=0
        )
        for i, result in zip(batch, results, strict=True):
            texts[i] = decode(result.hypotheses[0])
    return texts


def translation(
    translator: Compared, sentences: list[str], references: list[str], threads: int, repeats: int, compiled_rows: int | None = None
) -> dict[str, float]:
    """sentences/s and BLEU of every system, greedy and beam 4; ours also with the compiled decoder
    step at every row count up to compiled_rows (None: the slots, 64 x the beam size)."""
    hf_model = AutoModelForSeq2SeqLM.from_pretrained(translator.hf, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(translator.hf)
    encode, decode = ct2_tokens(translator, hf_tokenizer)
    adds_eos = bool(read_json(translator.ct2 / "config.json").get("add_source_eos", False))
    ct2 = {
        f"ct2_{kind}": ctranslate2.Translator(str(translator.ct2), device="cpu", compute_type=kind, intra_threads=threads)
        for kind in ["float32", "int8"]
    }
    results: dict[str, float] = {}
    for work, beam in [("translate_greedy", 1), ("translate_beam4", 4)]:
        slots = BATCH_SENTENCES * beam
        engine, engine_int8 = (offline_engine(translator.folder, slots, w) for w in (torch.float32, "int8"))
        started = time.perf_counter()
        sizes = tuple(range(1, min(compiled_rows or slots, slots) + 1))
        engine_compiled = offline_engine(translator.folder, slots, compiled_decode=sizes)
        results[f"{work}_start_seconds_{COMPILED}"] = time.perf_counter() - started
        engine_compiled_int8 = offline_engine(translator.folder, slots, "int8", compiled_decode=sizes)
        runs: dict[str, Callable[[list[str]], Outputs]] = {
            "ours": partial(engine_translate, engine, beam_size=beam),
            "ours_int8": partial(engine_translate, engine_int8, beam_size=beam),
            COMPILED: partial(engine_translate, engine_compiled, beam_size=beam),
            COMPILED_INT8: partial(engine_translate, engine_compiled_int8, beam_size=beam),
            "transformers": partial(transformers_translate, hf_model, hf_tokenizer, beam_size=beam, max_len=translator.max_len),
            **{
                name: partial(ct2_translate, model, encode, decode, beam_size=beam, max_len=translator.max_len, adds_eos=adds_eos)
                for name, model in ct2.items()
            },
        }
        measured = measure(runs, [sentences], sentences[:BATCH_SENTENCES], repeats)
        for system, m in measured.items():
            results[f"{work}_sentences_per_s_{system}"] = len(sentences) / m.seconds
            results[f"{work}_cpu_seconds_{system}"] = m.cpu_seconds
            results[f"{work}_bleu_{system}"] = sacrebleu.corpus_bleu(m.outputs, [references]).score
            print(f"  {work:18s} {system:13s} {len(sentences) / m.seconds:8.1f} sentences/s  BLEU {results[f'{work}_bleu_{system}']:.2f}")
        results.update(agreement(work, {system: m.outputs for system, m in measured.items()}))
    return results


def agreement(work: str, outputs: dict[str, Sequence[object]]) -> dict[str, float]:
    """<work>_same_as_ours_<system>: the share of outputs (texts, or texts and token counts) that equal ours (float32)."""
    ours = outputs["ours"]
    others = [s for s in outputs if s != "ours"]
    return {f"{work}_same_as_ours_{s}": sum(a == b for a, b in zip(ours, outputs[s], strict=True)) / len(ours) for s in others}


def engine_generate(engine: Engine, prompts: list[str]) -> list[Generated]:
    """Each prompt's greedy text and tokens: at most NEW_TOKENS, ended by an eos id of the engine's."""
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"g{i}", engine.runner.encode_prompt(prompt), GenerationParams(sampling=GREEDY, max_tokens=NEW_TOKENS)))
    texts, counts = [""] * len(prompts), [0] * len(prompts)
    while engine.has_work:
        for delta in engine.step().deltas:
            i = int(delta.request_id[1:])
            texts[i] += delta.text
            counts[i] += len(delta.token_ids)
            assert delta.finish_reason in (None, "stop", "length"), delta
    return list(zip(texts, counts, strict=True))


def transformers_generate(
    model: GPTNeoXForCausalLM, tokenizer: PreTrainedTokenizerBase, eos_ids: list[int], prompts: list[str]
) -> list[Generated]:
    """engine_generate's work through transformers: a row's tokens end before its first eos id."""
    batch = tokenizer(prompts, padding=True, return_tensors="pt")  # left-padded
    width = batch["input_ids"].shape[1]
    with torch.inference_mode():
        out = model.generate(  # type: ignore[misc]
            **batch, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
        )
    assert isinstance(out, torch.Tensor)
    rows: list[list[int]] = out[:, width:].tolist()  # an ended row is padded to the longest
    counts = [next((i for i, token in enumerate(row) if token in eos_ids), len(row)) for row in rows]
    return [(str(tokenizer.decode(row[:n], skip_special_tokens=True)), n) for row, n in zip(rows, counts, strict=True)]


def ct2_generate(
    generator: ctranslate2.Generator, encode: Encode, decode: Decode, eos_ids: list[int], prompts: list[str]
) -> list[Generated]:
    """engine_generate's work through CTranslate2 (which leaves out the end token it stopped on)."""
    results = generator.generate_batch(encode(prompts), max_length=NEW_TOKENS, end_token=eos_ids, include_prompt_in_result=False)
    return [(decode(r.sequences[0]), len(r.sequences_ids[0])) for r in results]


def generation(generator: Compared, threads: int, batch_1_prompts: int, repeats: int) -> dict[str, float]:
    """Generated tokens/s of every system: batch 1 (prompts one after another) and batch 16; ours
    also with the compiled decode step at every batch size up to the work's (COMPILED; the time its
    engine took to start, compiling and timing the step, is <work>_start_seconds_ours_compiled)."""
    hf_model = AutoModelForCausalLM.from_pretrained(generator.hf, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(generator.hf, padding_side="left")
    if hf_tokenizer.pad_token is None:  # GPT-NeoX tokenizers have none; the attention mask hides it
        hf_tokenizer.pad_token = hf_tokenizer.eos_token
    encode, decode = ct2_tokens(generator, hf_tokenizer)
    ct2 = {
        f"ct2_{kind}": ctranslate2.Generator(str(generator.ct2), device="cpu", compute_type=kind, intra_threads=threads)
        for kind in ["float32", "int8"]
    }
    results: dict[str, float] = {}
    for batch_size in [1, 16]:
        work = f"generate_batch_{batch_size}"
        engine, engine_int8 = (offline_engine(generator.folder, batch_size, w) for w in (torch.float32, "int8"))
        started = time.perf_counter()
        sizes = EngineConfig(n_slots=batch_size).decode_sizes(DEFAULT_COMPILED_DECODE, decoder_only=True)  # the service's
        engine_compiled = offline_engine(generator.folder, batch_size, compiled_decode=sizes)
        results[f"{work}_start_seconds_{COMPILED}"] = time.perf_counter() - started
        engine_compiled_int8 = offline_engine(generator.folder, batch_size, "int8", compiled_decode=sizes)
        eos_ids = sorted(engine.runner.eos_ids)
        runs: dict[str, Callable[[list[str]], list[Generated]]] = {
            "ours": partial(engine_generate, engine),
            "ours_int8": partial(engine_generate, engine_int8),
            COMPILED: partial(engine_generate, engine_compiled),
            COMPILED_INT8: partial(engine_generate, engine_compiled_int8),
            "transformers": partial(transformers_generate, hf_model, hf_tokenizer, eos_ids),
            **{name: partial(ct2_generate, model, encode, decode, eos_ids) for name, model in ct2.items()},
        }
        if batch_size == 1:  # prompts one after another
            batches = [[PROMPTS[i % len(PROMPTS)]] for i in range(batch_1_prompts)]
        else:
            batches = [[PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]]
        measured = measure(runs, batches, batches[0], repeats)
        for system, m in measured.items():
            tokens = sum(n for _, n in m.outputs)
            results[f"{work}_tokens_{system}"] = float(tokens)
            results[f"{work}_tokens_per_s_{system}"] = tokens / m.seconds
            results[f"{work}_cpu_seconds_{system}"] = m.cpu_seconds
            print(f"  {work:18s} {system:13s} {tokens / m.seconds:8.1f} tokens/s ({tokens} tokens)")
        results.update(agreement(work, {system: m.outputs for system, m in measured.items()}))
    return results


def per_cpu_second(results: dict[str, float], work: str, system: str) -> float:
    """A system's work per CPU second: generated tokens (<work>_tokens_<system>), or the
    translations, the same sentences for every system (counted as one)."""
    return results.get(f"{work}_tokens_{system}", 1.0) / results[f"{work}_cpu_seconds_{system}"]


def ratios(results: dict[str, float]) -> dict[str, float]:
    """<work>_vs_<peer>: our (float32) throughput over the peer's (wall time); <work>_int8_vs_<peer>:
    the same for our int8 weights, <work>_compiled_vs_<peer> with the compiled decode step;
    <work>[_int8|_compiled]_vs_<peer>_by_cpu: the same from CPU time (our work
    per CPU second over the peer's)."""
    out = {}
    for key in list(results):
        for unit in ["_sentences_per_s", "_tokens_per_s"]:
            if key.endswith(f"{unit}_ours"):
                work = key[: -len(f"{unit}_ours")]
                for ours, name in [
                    ("ours", work),
                    ("ours_int8", f"{work}_int8"),
                    (COMPILED, f"{work}_compiled"),
                    (COMPILED_INT8, f"{work}_int8_compiled"),
                ]:
                    if f"{work}{unit}_{ours}" not in results:
                        continue  # a run without it
                    for peer in PEERS:
                        out[f"{name}_vs_{peer}"] = results[f"{work}{unit}_{ours}"] / results[f"{work}{unit}_{peer}"]
                        out[f"{name}_vs_{peer}_by_cpu"] = per_cpu_second(results, work, ours) / per_cpu_second(results, work, peer)
    return out


def plot(results: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = [
        ("translate_greedy", "sentences_per_s", f"translation, greedy, {results['sentences']:.0f} sentences (sentences/s)"),
        ("translate_beam4", "sentences_per_s", f"translation, beam 4, {results['sentences']:.0f} sentences (sentences/s)"),
        ("generate_batch_1", "tokens_per_s", "generation, batch 1 (tokens/s)"),
        ("generate_batch_16", "tokens_per_s", "generation, batch 16 (tokens/s)"),
    ]
    palette = ["tab:blue", "tab:cyan", "tab:orange", "tab:green", "tab:olive", "tab:purple", "tab:red"]
    colors = dict(zip([*SYSTEMS, COMPILED, COMPILED_INT8], palette, strict=True))
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, (work, unit, title) in zip(axes.flat, works, strict=True):
        systems = [s for s in colors if f"{work}_{unit}_{s}" in results]
        values = [results[f"{work}_{unit}_{s}"] for s in systems]
        labels = [s.replace("_", "\n") for s in systems]
        if work.startswith("translate"):
            labels = [f"{label}\nBLEU {results[f'{work}_bleu_{s}']:.1f}" for label, s in zip(labels, systems, strict=True)]
        bars = ax.bar(labels, values, color=[colors[s] for s in systems])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"Ours vs transformers and CTranslate2 on CPU, {results['threads']:.0f} thread(s), same inputs and batch sizes\n"
        f"(wall-clock throughput; the run had {results['cpu_seconds_per_second']:.2f} CPU-seconds per second)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def checked(folder: Path, kind: ModelKind) -> FolderInfo:
    """What inspect_folder says of folder, or SystemExit with one line when it is not a kind folder."""
    try:
        info = inspect_folder(folder)
    except CheckpointError as error:
        raise SystemExit(f"peers: {error}") from None
    if info.kind != kind:
        raise SystemExit(f"peers: {folder} holds a {info.kind} ({info.architecture}), not a {kind}")
    return info


def multi30k_test_set(folder: Path, info: FolderInfo) -> tuple[list[str], list[str]]:
    """Multi30k's test_2016_flickr sources and references in the translator's languages, or
    SystemExit with one line when there are none."""
    paths = [MULTI30K / f"test_2016_flickr.{lang}.gz" for lang in (info.source_lang, info.target_lang)]
    if info.source_lang is None or info.target_lang is None or not all(p.is_file() for p in paths):
        have = ", ".join(sorted(p.name.split(".")[1] for p in MULTI30K.glob("test_2016_flickr.*.gz")))
        raise SystemExit(f"peers: no Multi30k test_2016 data for {folder} ({info.source_lang} -> {info.target_lang}); languages: {have}")
    sources, references = (read_lines(p) for p in paths)
    return sources, references


def check_context(generator: Compared) -> None:
    """SystemExit with one line when the generator's context cannot hold a prompt and NEW_TOKENS."""
    longest = max(len(ids) for ids in AutoTokenizer.from_pretrained(generator.hf)(PROMPTS)["input_ids"])
    if longest + NEW_TOKENS > generator.max_len:
        raise SystemExit(
            f"peers: {generator.folder} serves {generator.max_len} positions, fewer than a prompt ({longest}) and {NEW_TOKENS} new tokens"
        )


def default_out(translator: Path, generator: Path) -> Path:
    """benchmarks/results for the shipped checkpoints; benchmarks/results/peers-<translator
    name>+<generator name> when either is another folder, so the docs' figures stay."""
    if translator.resolve() == DEFAULT_TRANSLATOR.resolve() and generator.resolve() == DEFAULT_GENERATOR.resolve():
        return RESULTS
    return RESULTS / f"peers-{translator.resolve().name}+{generator.resolve().name}"


def tokenization_note(name: str, model: Compared) -> str:
    if model.hugging_face:
        return f"tokenization ({name}): every system with the folder's tokenizer (CTranslate2 given its tokens)"
    return (
        f"tokenization ({name}): ours and CTranslate2 with our sentencepiece model, transformers with the exported AutoTokenizer (same ids)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--translator", type=Path, default=DEFAULT_TRANSLATOR, help="our translator folder or a Hugging Face MarianMT one")
    parser.add_argument(
        "--generator", type=Path, default=DEFAULT_GENERATOR, help="our generator folder or a Hugging Face one (GPT-NeoX, Llama family)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads and ctranslate2 intra_threads")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="where peers.json and peers.png go (default: see above)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each measure, the best kept")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"100 sentences, 2 prompts at batch 1, one repeat: to check the script (files to {QUICK_RESULTS})",
    )
    args = parser.parse_args()
    translator_info, generator_info = checked(args.translator, "translator"), checked(args.generator, "generator")
    sentences, references = multi30k_test_set(args.translator, translator_info)
    out: Path = args.out or (QUICK_RESULTS if args.quick else default_out(args.translator, args.generator))
    out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")  # Moses normalisation is not part of encoding
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.quick:
        sentences, references = sentences[:100], references[:100]
    results: dict[str, float] = {"threads": float(args.threads), "sentences": float(len(sentences)), "new_tokens": float(NEW_TOKENS)}
    repeats = 1 if args.quick else args.repeats
    started, cpu_started = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        generator = prepare(args.generator, generator_info.hugging_face, Path(tmp) / "generator")
        check_context(generator)
        translator = prepare(args.translator, translator_info.hugging_face, Path(tmp) / "translator")
        compiled_rows = QUICK_COMPILED_ROWS if args.quick else None
        results.update(translation(translator, sentences, references, args.threads, repeats, compiled_rows))
        results.update(generation(generator, args.threads, 2 if args.quick else 4, repeats))
    results.update(ratios(results))
    results["seconds"] = time.perf_counter() - started
    # Near 1 with one thread on an idle machine; lower when other processes took the cores.
    results["cpu_seconds_per_second"] = (time.process_time() - cpu_started) / results["seconds"]
    models = {"translator": translator.describe(translator_info), "generator": generator.describe(generator_info)}
    notes = [
        "ours_int8: int8 linear layers and output projection, one scale per token and per output channel (model/quantize.py)",
        f"{COMPILED}: ours with the decode step compiled by torch.compile at every batch size up to the work's (in translation: "
        "rows, each beam one), where its start measured it faster, one size timed per power-of-two bucket "
        "(EngineConfig.compiled_decode; the service's default); in generation every row count a step decodes "
        "(a verification of drafts a row per token), as the service compiles them",
        f"{COMPILED_INT8}: ours_int8 with the decode step compiled as {COMPILED}",
        f"translation: {BATCH_SENTENCES} sentences in flight for every system (our engine: {BATCH_SENTENCES} x beam size slots)",
        tokenization_note("translator", translator),
        tokenization_note("generator", generator),
        "outputs: the peers stop a batch at its longest sentence's limit, ours each sentence at its own (same_as_ours below 1)",
        *(f"{name}: {m['path']} ({m['kind']})" for name, m in models.items()),
    ]
    report = {"commit": commit(), "machine": machine(), **results, "models": models, "notes": notes}
    (out / "peers.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, out / "peers.png")
    print(f"{'metric':45s} value")
    for key, value in results.items():
        print(f"{key:45s} {value:10.2f}")
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {out / 'peers.json'} and {out / 'peers.png'}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
