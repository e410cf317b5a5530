"""The engine on Hugging Face folders (built in the test, random weights): continuous batching of
many requests at once gives transformers' own generate() answers, greedy and beam 4; on a Llama
(grouped-query attention) through the dynamic and the bucketed fixed-shape steps, with each
token's logprob equal to transformers' logits."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from decoding.sampling_params import GREEDY, SamplingParams
from decoding.translate import max_new_tokens_for
from loading.checkpoint import load_checkpoint
from model.generator import Generator
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner
from tests.engine.helpers import deltas_of, run
from tests.hf_folders import build_gpt_neox_folder, build_llama_folder, build_marian_folder
from training.data import SHARED_DATA, read_lines

SENTENCES = 40


@pytest.fixture(scope="module")
def marian(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_marian_folder(tmp_path_factory.mktemp("marian"))


@pytest.fixture(scope="module")
def neox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_neox_folder(tmp_path_factory.mktemp("neox"))


def run_all(engine: Engine, prompts: list[list[int]], params: GenerationParams) -> list[str]:
    """Every prompt submitted at once; each request's text."""
    streams = deltas_of(engine, {0: [Request(str(i), prompt, params) for i, prompt in enumerate(prompts)]})
    return ["".join(d.text for d in deltas) for deltas in streams.values()]


@torch.inference_mode()
def test_marian_folder_in_the_engine_answers_as_transformers(marian: Path) -> None:
    sentences = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")[:SENTENCES]
    tokenizer, hf = AutoTokenizer.from_pretrained(marian), AutoModelForSeq2SeqLM.from_pretrained(marian).eval()
    engine = Engine.from_checkpoint(marian, EngineConfig(n_slots=64, max_waiting=256), "cpu", torch.float32)
    prompts = [engine.runner.encode_prompt(s) for s in sentences]
    assert prompts == tokenizer(sentences)["input_ids"]  # the engine's source ids end with </s>, as Marian's

    def theirs(beam_size: int) -> list[str]:
        texts = []
        for ids in prompts:
            beam = {"num_beams": beam_size, "length_penalty": 1.0, "early_stopping": True} if beam_size > 1 else {}
            limit = max_new_tokens_for(len(ids), hf.config.max_position_embeddings)
            out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=limit, do_sample=False, **beam)
            texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
        return texts

    assert run_all(engine, prompts, GenerationParams(sampling=GREEDY)) == theirs(1)
    ours, expected = run_all(engine, prompts, GenerationParams(beam_size=4, length_penalty=1.0)), theirs(4)
    same = sum(a == b for a, b in zip(ours, expected, strict=True))
    assert same >= 0.95 * len(sentences), [(a, b) for a, b in zip(ours, expected, strict=True) if a != b][:3]


@torch.inference_mode()
def test_gpt_neox_folder_in_the_engine_answers_as_transformers(neox: Path) -> None:
    prompts_text = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further", "Thou art café naïve", "O", "KING HENRY:\nNow"]
    tokenizer, hf = AutoTokenizer.from_pretrained(neox), AutoModelForCausalLM.from_pretrained(neox).eval()
    engine = Engine.from_checkpoint(neox, EngineConfig(n_slots=8), "cpu", torch.float32)
    prompts = [engine.runner.encode_prompt(p) for p in prompts_text]
    assert prompts == [tokenizer(p)["input_ids"] for p in prompts_text]
    expected = []
    for ids in prompts:
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=30, do_sample=False)
        expected.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    assert run_all(engine, prompts, GenerationParams(max_tokens=30, sampling=GREEDY)) == expected


@torch.inference_mode()
def test_repetition_penalty_in_the_engine_is_transformers(neox: Path) -> None:
    prompts_text = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further", "O"]
    tokenizer, hf = AutoTokenizer.from_pretrained(neox), AutoModelForCausalLM.from_pretrained(neox).eval()
    engine = Engine.from_checkpoint(neox, EngineConfig(n_slots=8), "cpu", torch.float32)
    prompts = [engine.runner.encode_prompt(p) for p in prompts_text]
    expected = []
    for ids in prompts:
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=30, do_sample=False, repetition_penalty=1.5)
        expected.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert run_all(engine, prompts, GenerationParams(max_tokens=30, sampling=penalized)) == expected
    assert run_all(engine, prompts, GenerationParams(max_tokens=30, sampling=GREEDY)) != expected  # the penalty changed something


@torch.inference_mode()
def test_min_tokens_in_the_engine_is_transformers_min_new_tokens(tmp_path: Path) -> None:
    folder = build_llama_folder(tmp_path / "llama")  # two eos ids: neither may end it early
    texts = ["ROMEO:\n", "O", "KING HENRY:\nNow, lords"]
    tokenizer, hf = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    # Random weights rarely pick an eos: its output row becomes the first greedy token's, scaled up,
    # so that the first prompt would end at once.
    first = int(hf.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=1, do_sample=False)[0, -1])
    eos = hf.generation_config.eos_token_id[0]
    hf.lm_head.weight[eos] = 2 * hf.lm_head.weight[first]
    hf.save_pretrained(folder)
    assert hf.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False)[0, -1] == eos  # without min_tokens
    engine = Engine.from_checkpoint(folder, EngineConfig(n_slots=8), "cpu", torch.float32)
    assert [engine.runner.encode_prompt(t) for t in texts] == prompts
    params = GenerationParams(max_tokens=24, min_tokens=12, sampling=GREEDY)
    tokens = run(engine, {0: [Request(str(i), prompt, params) for i, prompt in enumerate(prompts)]})
    for ids, ours in zip(prompts, tokens.values(), strict=True):
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=24, min_new_tokens=12, do_sample=False)
        theirs = out[0, len(ids) :].tolist()
        if theirs[-1] in engine.runner.eos_ids:
            theirs.pop()  # the eos that ended it: the engine streams no token for it
        assert ours == theirs and len(ours) >= 12


@torch.inference_mode()
@pytest.mark.parametrize("fixed_shape", [False, True], ids=["dynamic", "fixed-shape"])
def test_llama_folder_in_the_engine_answers_and_scores_as_transformers(tmp_path: Path, fixed_shape: bool) -> None:
    folder = build_llama_folder(tmp_path / "llama")  # 4 query heads over 2 key/value heads, untied, two eos ids
    texts = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further", "O", "KING HENRY:\nNow, lords"]
    tokenizer, hf = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    model, ours = load_checkpoint(folder)
    assert isinstance(model, Generator) and model.config.kv_heads == 2
    config = EngineConfig(n_slots=8)
    engine = Engine(GeneratorRunner(model, ours, config, fixed_shape_decode=fixed_shape), config)
    prompts = [engine.runner.encode_prompt(t) for t in texts]
    assert prompts == [tokenizer(t)["input_ids"] for t in texts]  # with its bos
    params = GenerationParams(max_tokens=20, sampling=GREEDY, logprobs=2)
    streams = deltas_of(engine, {0: [Request(str(i), prompt, params) for i, prompt in enumerate(prompts)]}).values()
    tokens = [[t for d in deltas for t in d.token_ids] for deltas in streams]
    logprobs = [[s.logprob for d in deltas for s in d.logprobs or [] if s.logprob is not None] for deltas in streams]
    for ids, generated, scored in zip(prompts, tokens, logprobs, strict=True):
        out = hf.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        theirs = out.sequences[0, len(ids) :].tolist()
        if theirs[-1] in model.config.eos_ids:
            theirs.pop()  # the eos that ended it: the engine streams no token for it
        assert generated == theirs
        expected = [float(F.log_softmax(logits[0].float(), dim=-1)[t]) for logits, t in zip(out.logits, generated, strict=False)]
        assert torch.allclose(torch.tensor(scored), torch.tensor(expected), atol=1e-4)
