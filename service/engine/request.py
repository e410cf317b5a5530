"""What a request asks for, its progress through the engine, and what it streams back."""

import time
from dataclasses import dataclass, field
from enum import Enum

import llguidance
import torch

from decoding.beam_search import BeamState
from decoding.sampling_params import SamplingParams
from service.engine.config import FinishReason, StructuredOutput, TokenLogprob
from service.engine.speculation import PromptLookup


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class GenerationParams:
    """What to produce. max_tokens None: the engine's default for the prompt (Engine.resolve).
    beam_size > 1 (translator only) returns n_best hypotheses at the end instead of streaming
    tokens, and ignores sampling. logprobs (generator only): each generated token's
    log-probability with this many top alternatives, from the logits it was sampled from (after
    suppressed ids, before penalties, temperature and top-k/top-p, as vLLM's raw logprobs); prompt_logprobs: the same for every
    prompt token after the first, from the prefill; with it, max_tokens 0 scores the prompt alone."""

    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    beam_size: int = 1
    n_best: int = 1
    length_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # no eos id is sampled (transformers' min_new_tokens) and no stop string ends within this many tokens
    ignore_eos: bool = False  # an eos id does not end the sequence (vLLM's, for fixed-length benchmarks)
    structured: StructuredOutput | None = None  # the output follows this grammar (service/engine/grammar.py)
    speculate: bool = True  # False: never speculative decoding for this request (EngineConfig.num_speculative_tokens)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]  # generator: the prompt; translator: the source sentence (with eos)
    params: GenerationParams
    arrival_time: float = field(default_factory=lambda: time.monotonic())  # looked up per request: a test's clock applies
    status: RequestStatus = RequestStatus.WAITING
    slots: list[int] = field(default_factory=list)  # cache rows held (beam_size of them while running)
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose keys are in the KV cache: a decoder-only model's of prompt_ids + output_ids, an
    # encoder-decoder's decoder tokens (each row's); the prompt's logprobs gathered over its chunks
    # until the prompt is done (decoder-only).
    num_computed_tokens: int = 0
    prompt_logprobs_so_far: list[TokenLogprob] = field(default_factory=list)
    preemptions: int = 0
    finish_reason: FinishReason | None = None
    rng: torch.Generator | None = None  # per-request sampling randomness
    beams: BeamState | None = None  # a beam search's live beams and ended hypotheses (the translator's runner)
    grammar: llguidance.LLMatcher | None = None  # params.structured's matcher, advanced by every token generated
    lookup: PromptLookup | None = None  # speculative decoding's proposer (the engine's, when it speculates for the request)
    draft_ids: list[int] = field(default_factory=list)  # proposed to follow output_ids, verified by the next decode step
    scheduled_time: float | None = None  # when it left the waiting queue
    first_token_time: float | None = None
    last_token_time: float = 0.0

    @property
    def max_tokens(self) -> int:
        """The output length limit, once the engine has resolved the parameters."""
        assert self.params.max_tokens is not None, "parameters not resolved by the engine"
        return self.params.max_tokens

    @property
    def token_ids(self) -> list[int]:
        """The prompt and what has been generated, in order (a new list)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens_at(self, start: int, n: int) -> list[int]:
        """token_ids[start : start + n] without building token_ids (a step's tokens, every step)."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start : start + n] + self.output_ids[max(start - prompt, 0) : max(start + n - prompt, 0)]

    @property
    def cost(self) -> int:
        """Tokens the request computes at most (prompt and max_tokens, every beam): what it weighs in the waiting queue."""
        return (len(self.prompt_ids) + (self.params.max_tokens or 0)) * self.params.beam_size

    @property
    def slots_needed(self) -> int:
        return self.params.beam_size

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class Delta:
    """One piece of a request's stream. The last one has finish_reason set."""

    request_id: str
    text: str  # new text; never splits a UTF-8 character
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    alternatives: list[str] | None = None  # beam search: the n-best translations, best first
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far, including this delta
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta: the prompt's tokens (the first scored None)

    def followed_by(self, later: "Delta") -> "Delta":
        """This delta and the next one of the same stream, as one."""
        assert later.request_id == self.request_id and self.finish_reason is None, "merging across streams or past the end"
        return Delta(
            self.request_id,
            self.text + later.text,
            self.token_ids + later.token_ids,
            later.finish_reason,
            later.alternatives,
            later.prompt_tokens or self.prompt_tokens,
            later.completion_tokens,
            later.error,
            self.logprobs + (later.logprobs or []) if self.logprobs is not None else later.logprobs,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )
