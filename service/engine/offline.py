"""Offline batch decoding through the serving engine, in-process (vLLM's `LLM` class): what
training/ (validation BLEU), `python -m training.evaluate`, the exports' checks and the tests
decode with, so that the scores the project reports come from the engine it serves. No Ray, no
HTTP, no threads: the caller's thread steps the engine.

Contract of `OfflineEngine(model, tokenizer, n_slots).generate(prompts, params)`:
- prompts: texts, encoded as the service encodes them (`runner.encode_prompt`: a translator's
  source ends with eos), or token ids, taken as they are; params: one GenerationParams for every
  prompt, or one per prompt (default: greedy, the engine's default length limit).
- Returns one Completion per prompt, in input order: the best output's token ids (no start token,
  no eos) and its text, and with beam search the n_best texts, best first.
- Every request is queued at once (max_waiting is the number of prompts) with no deadlines, and
  the engine steps until all have finished: n_slots sequences run together (each beam a slot).
  A request the engine refuses raises InvalidRequestError before anything is decoded; a step
  that fails in the model raises RuntimeError.
- An output does not depend on the other prompts of the call, nor on n_slots (tests/engine/test_offline.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from decoding.sampling_params import GREEDY
from loading.tokenizer import TextTokenizer
from model.generator import Generator
from model.translator import Translator
from service.engine.config import EngineConfig, FinishReason
from service.engine.engine import Engine
from service.engine.request import Delta, GenerationParams, Request
from service.engine.runner import runner_for

GREEDY_PARAMS = GenerationParams(sampling=GREEDY)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the best output's ids, without the start token and eos
    text: str  # its text, as the service answers it
    texts: list[str]  # beam search: the n_best texts, best first (texts[0] is text); else [text]
    finish_reason: FinishReason


class OfflineEngine:
    """An Engine over a model and its tokenizer, made for each `generate` call (no deadlines, a
    queue that holds the whole call). config: further EngineConfig fields (e.g. max_num_batched_tokens)."""

    def __init__(self, model: Translator | Generator, tokenizer: TextTokenizer, n_slots: int = 64, **config: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = EngineConfig(n_slots=n_slots, queue_timeout_s=None, request_timeout_s=None, **config)

    def generate(
        self, prompts: Sequence[str | list[int]], params: GenerationParams | Sequence[GenerationParams] = GREEDY_PARAMS
    ) -> list[Completion]:
        if not prompts:
            return []
        config = replace(self.config, max_waiting=len(prompts))
        engine = Engine(runner_for(self.model, self.tokenizer, config), config)
        each = [params] * len(prompts) if isinstance(params, GenerationParams) else params  # zip below: one per prompt
        requests = [
            Request(str(i), engine.runner.encode_prompt(p) if isinstance(p, str) else list(p), ps)
            for i, (p, ps) in enumerate(zip(prompts, each, strict=True))
        ]
        for r in requests:
            engine.resolve(r.prompt_ids, r.params)  # every refusal before any request is queued
        for r in requests:
            engine.add_request(r)
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        finals: dict[str, Delta] = {}
        while engine.has_work:
            step = engine.step()
            if step.error is not None:
                raise RuntimeError(f"a decoding step failed: {step.error!r}") from step.error
            for delta in step.deltas:
                texts[delta.request_id].append(delta.text)
                if delta.finish_reason is not None:
                    finals[delta.request_id] = delta
        completions = []
        for r in requests:
            final, text = finals[r.request_id], "".join(texts[r.request_id])
            assert final.finish_reason is not None
            completions.append(Completion(list(r.output_ids), text, [text, *(final.alternatives or [])], final.finish_reason))
        return completions
