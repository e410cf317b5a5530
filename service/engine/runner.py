"""Model runners: one step of tensors for the requests a plan names. Token ids in, token ids out."""

import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from model.beam_search import BeamState, Hypothesis, step_beams
from model.generator import Generator
from model.kv_cache import CrossAttentionCache, KVCache
from model.sampling import adjust_logits, sample_next, suppress, suppressed_index
from model.tokenizer import TextTokenizer
from model.translate import max_new_tokens_for, pad_batch
from model.translator import Translator
from service.engine.config import TokenLogprob, serving_context
from service.engine.fixed_shape import Fed, GeneratorDecoder, TranslatorDecoder
from service.engine.request import Request
from service.engine.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    """What one execute() produced, by request id. A request of the plan is in exactly one of
    tokens (a streamed, greedy or sampled, sequence's next token) and hypotheses (a beam search
    that ended this step, best first), or in neither (a beam search still running)."""

    tokens: dict[str, int] = field(default_factory=dict)
    hypotheses: dict[str, list[Hypothesis]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # the token's, for requests that ask (GenerationParams)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # at the prefill, for those that ask
    prefill_seconds: float = 0.0  # the prompt / encoder pass of the plan's new requests


class ModelRunner(Protocol):
    """Special ids are the model's (its config): any of eos_ids ends a sequence, its suppressed_ids
    are never generated, and sizes follow the serving context (EngineConfig.max_context)."""

    tokenizer: TextTokenizer
    eos_id: int  # the model's first end-of-sequence id (a translator's source ends with it)
    eos_ids: frozenset[int]  # a streamed sequence's tokens that end it (never emitted as text)
    pad_id: int
    max_len: int  # the serving context: a sequence's prompt and output together
    max_prompt_len: int  # longest prompt (generator) or source (translator), in tokens
    strip_leading_space: bool  # output text starts without the word-boundary space its first token carries

    def max_new_tokens(self, prompt_length: int) -> int:
        """The most tokens a request with this prompt can generate before its slot is full."""

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt (generator) or source sentence (translator, ending with eos)."""

    def default_max_tokens(self, prompt_length: int) -> int:
        """The output length limit when a request sets none."""

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """One step: the prefill of plan.prefill, then one token for every running sequence."""

    @property
    def kv_cache_bytes(self) -> int: ...


def _sample(logits: Tensor, requests: list[Request], eos_ids: frozenset[int]) -> list[int]:
    """Each request's next token from its row of logits (B, V), suppressed ids already at -inf:
    after its penalties and logit bias, and with eos_ids at -inf before its min_tokens (on a copy:
    the logits stay as they are, for logprobs)."""
    for r in requests:
        if r.rng is None and not r.params.sampling.greedy:
            seed = r.params.sampling.seed if r.params.sampling.seed is not None else secrets.randbits(63)
            r.rng = torch.Generator().manual_seed(seed)

    def adjusted(row: Tensor, r: Request) -> Tensor:
        if r.params.sampling.adjusts_logits:
            row = adjust_logits(row, r.params.sampling, r.prompt_ids, r.output_ids)
        if len(r.output_ids) < r.params.min_tokens:
            row = row.float().index_fill(-1, torch.tensor(sorted(eos_ids), device=row.device), float("-inf"))
        return row.float()

    if any(r.params.sampling.adjusts_logits or len(r.output_ids) < r.params.min_tokens for r in requests):
        logits = torch.stack([adjusted(row, r) for row, r in zip(logits, requests, strict=True)])  # (B, V)
    return sample_next(logits, [r.params.sampling for r in requests], [r.rng for r in requests]).tolist()


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its token under logits (R, V), with the `top` most likely."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (R, V)
    chosen = log_probs.gather(1, torch.tensor(tokens, dtype=torch.long, device=logits.device).unsqueeze(1))[:, 0].tolist()  # (R,)
    best, best_ids = log_probs.topk(top, dim=-1) if top else (log_probs[:, :0], log_probs[:, :0].long())  # (R, top)
    return [
        TokenLogprob(token, logprob, tuple(zip(ids, values, strict=True)))
        for token, logprob, ids, values in zip(tokens, chosen, best_ids.tolist(), best.tolist(), strict=True)
    ]


def record_logprobs(output: RunnerOutput, logits: Tensor, tokens: list[int], requests: list[Request]) -> None:
    """The sampled tokens' logprobs (logits (B, V), as sampled from) of the requests that ask."""
    for row, (r, token) in enumerate(zip(requests, tokens, strict=True)):
        if r.params.logprobs is not None:
            (output.logprobs[r.request_id],) = token_logprobs(logits[row : row + 1], [token], r.params.logprobs)


class GeneratorRunner:
    """Decoder-only: batched prefill of new prompts, then one decode step for every running sequence."""

    def __init__(
        self,
        model: Generator,
        tokenizer: TextTokenizer,
        n_slots: int,
        fixed_shape_decode: bool | None = None,
        max_context: int | None = None,
    ) -> None:
        """fixed_shape_decode: decode through fixed-shape steps by bucket, CUDA graphs on a GPU
        (service/engine/fixed_shape.py; default: on CUDA devices, eager on others).
        max_context: EngineConfig.max_context (None: its default), the cache's length."""
        c = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.max_len = serving_context(max_context, c.max_len)  # prompt + output
        self.cache = KVCache(c.n_layers, n_slots, c.kv_heads, self.max_len, c.head_dim, self.device, dtype)  # keys of the KV heads
        self.max_prompt_len = self.max_len - 1
        self.bos_id, self.eos_id, self.pad_id = c.bos_id, c.eos_id, c.pad_id
        self.eos_ids = frozenset(c.eos_ids)
        self.suppressed = suppressed_index(c.suppressed_ids, self.device)
        self.strip_leading_space = False  # a play's text keeps its layout
        if fixed_shape_decode is None:
            fixed_shape_decode = self.device.type == "cuda"
        self.fixed_shape = GeneratorDecoder(model, self.cache, capture=self.device.type == "cuda") if fixed_shape_decode else None

    def max_new_tokens(self, prompt_length: int) -> int:
        return self.max_len - prompt_length

    def encode_prompt(self, text: str) -> list[int]:
        """The text's ids with the special tokens the model's tokenizer puts before a prompt (a
        Llama's bos); bos alone for text without tokens (generation from nothing)."""
        return self.tokenizer.encode_prompt(text) or [self.bos_id]

    def default_max_tokens(self, prompt_length: int) -> int:
        return self.max_new_tokens(prompt_length)

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        output = RunnerOutput()
        if plan.prefill:
            started = time.perf_counter()
            self._prefill(plan.prefill, output)
            output.prefill_seconds = time.perf_counter() - started
        if plan.decode:
            self._decode(plan.decode, output)
        return output

    def _prefill(self, requests: list[Request], output: RunnerOutput) -> None:
        ids = pad_batch([r.prompt_ids for r in requests], self.pad_id).to(self.device)  # (B, T) right-padded
        B, T = ids.shape
        slots = [r.slots[0] for r in requests]
        positions = torch.arange(T, device=self.device).expand(B, T)
        logits = self.model(ids, positions, self.cache.views(slots, positions, T), T)  # (B, T, V)
        last = torch.tensor([len(r.prompt_ids) - 1 for r in requests], device=self.device)
        next_logits = suppress(logits[torch.arange(B, device=self.device), last], self.suppressed)  # (B, V)
        tokens = _sample(next_logits, requests, self.eos_ids)
        output.tokens.update({r.request_id: t for r, t in zip(requests, tokens, strict=True)})
        record_logprobs(output, next_logits, tokens, requests)
        for row, r in enumerate(requests):
            if r.params.prompt_logprobs is not None:  # position t's logits score prompt token t + 1
                scored = token_logprobs(logits[row, : len(r.prompt_ids) - 1], r.prompt_ids[1:], r.params.prompt_logprobs)
                output.prompt_logprobs[r.request_id] = [TokenLogprob(r.prompt_ids[0], None), *scored]

    def _decode(self, requests: list[Request], output: RunnerOutput) -> None:
        logits = suppress(self.decode_logits({r.slots[0]: (r.output_ids[-1], _position(r)) for r in requests}), self.suppressed)
        tokens = _sample(logits, requests, self.eos_ids)
        output.tokens.update({r.request_id: t for r, t in zip(requests, tokens, strict=True)})
        record_logprobs(output, logits, tokens, requests)

    def decode_logits(self, fed: Fed) -> Tensor:
        """Next-token logits (R, V) of one decode step, a row per sequence of fed (slot -> (token,
        position)) in its order, suppressed ids not yet applied: the fixed-shape step or the dynamic one."""
        if self.fixed_shape is not None:
            return self.fixed_shape(fed)
        step = decode_step(fed, self.max_len, self.pad_id, self.device)
        views = self.cache.views(step.rows, step.positions, step.length)
        logits = self.model(step.ids, step.positions, views, step.length)[:, -1]  # (rows, V)
        return logits.index_select(0, torch.tensor([step.row_of[s] for s in fed], device=self.device))


def _position(r: Request) -> int:
    """Position of the token a running generator request feeds this step (its latest)."""
    return len(r.prompt_ids) + len(r.output_ids) - 1


@dataclass(frozen=True)
class DecodeStep:
    """The cache rows one decode step runs and what each row is fed."""

    rows: list[int]  # from decode_rows
    row_of: dict[int, int]  # slot -> its row's index in the step's batch
    ids: Tensor  # (R, 1) each row's token; idle rows the model's pad
    positions: Tensor  # (R, 1) where it goes; idle rows the last position, which every sequence writes before it reads it
    length: int  # keys attended over: the furthest position + 1


def decode_step(fed: dict[int, tuple[int, int]], max_len: int, pad_id: int, device: torch.device) -> DecodeStep:
    """fed: slot -> (token, position) of every sequence running this step; max_len: the cache's length."""
    rows = decode_rows(list(fed))
    idle = (pad_id, max_len - 1)
    ids = torch.tensor([[fed.get(s, idle)[0]] for s in rows], device=device)  # (R, 1)
    positions = torch.tensor([[fed.get(s, idle)[1]] for s in rows], device=device)  # (R, 1)
    length = max(position for _, position in fed.values()) + 1
    return DecodeStep(rows, {s: i for i, s in enumerate(rows)}, ids, positions, length)


def beam_group(slots_of_requests: list[list[int]], rows: list[int]) -> int:
    """k when every request of a step holds k > 1 slots (a beam search of width k) forming a block
    that starts at a multiple of k, and the step's rows are such blocks (idle ones included):
    every k consecutive rows then share one source. Else 1. (The allocator hands out the lowest
    free slots, so beam searches of one width keep to aligned blocks.)"""
    widths = {len(slots) for slots in slots_of_requests}
    k = widths.pop() if len(widths) == 1 else 1
    if k == 1 or len(rows) % k:
        return 1
    # Slots and rows ascend without repeats, so a block of k is aligned and consecutive when its
    # first is a multiple of k and its last k - 1 further.
    blocks = [(slots[0], slots[-1]) for slots in slots_of_requests] + [(rows[i], rows[i + k - 1]) for i in range(0, len(rows), k)]
    return k if all(first % k == 0 and last == first + k - 1 for first, last in blocks) else 1


def decode_rows(slots: list[int]) -> list[int]:
    """Cache rows a decode step runs: the consecutive span from the lowest to the highest slot, idle
    rows included, so that every layer reads the cache through a view instead of gathering a
    copy of each row (the copy grows with batch x length). Past twice the batch, the idle rows'
    compute is taken to outweigh the copies saved (a heuristic); then just the slots, ascending."""
    first, last = min(slots), max(slots)
    if last - first + 1 <= 2 * len(slots):
        return list(range(first, last + 1))
    return sorted(slots)


class TranslatorRunner:
    """Encoder-decoder: new sources are encoded once (their cross-attention keys/values written to
    their slots), then every running sequence, each beam a row, takes one decoder step together."""

    def __init__(
        self,
        model: Translator,
        tokenizer: TextTokenizer,
        n_slots: int,
        max_context: int | None = None,
        fixed_shape_decode: bool | None = None,
    ) -> None:
        """max_context: EngineConfig.max_context (None: its default), the length of the source
        (cross-attention) and target caches. fixed_shape_decode: as GeneratorRunner's."""
        c = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        n_layers = len(model.decoder_layers)
        self.max_len = serving_context(max_context, c.max_len)
        self.cache = KVCache(n_layers, n_slots, c.n_heads, self.max_len, c.head_dim, self.device, dtype)
        self.cross_cache = CrossAttentionCache(n_layers, n_slots, c.n_heads, self.max_len, c.head_dim, self.device, dtype)
        self.max_prompt_len = self.max_len
        self.start_id, self.eos_id, self.pad_id = c.start_id, c.eos_id, c.pad_id
        self.eos_ids = frozenset(c.eos_ids)
        self.suppressed = suppressed_index(c.suppressed_ids, self.device)
        self.strip_leading_space = True  # sentence tokenizers start a sentence with a word-boundary space
        if fixed_shape_decode is None:
            fixed_shape_decode = self.device.type == "cuda"
        capture = self.device.type == "cuda"
        self.fixed_shape = TranslatorDecoder(model, self.cache, self.cross_cache, capture) if fixed_shape_decode else None

    def max_new_tokens(self, prompt_length: int) -> int:
        return self.max_len - 1  # position 0 holds the start token

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text) + [self.eos_id]

    def default_max_tokens(self, prompt_length: int) -> int:
        return max_new_tokens_for(prompt_length, self.max_len)

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes + self.cross_cache.nbytes

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        output = RunnerOutput()
        if plan.prefill:
            started = time.perf_counter()
            self._encode(plan.prefill)
            output.prefill_seconds = time.perf_counter() - started
        self._decode(plan.prefill + plan.decode, output)
        return output

    def _encode(self, requests: list[Request]) -> None:
        src = pad_batch([r.prompt_ids for r in requests], self.pad_id).to(self.device)  # (B, S)
        memory_kv = self.model.cross_key_values(self.model.encode(src))
        # Each beam row gets its own copy of its sentence's keys/values.
        rows = torch.tensor([i for i, r in enumerate(requests) for _ in r.slots], device=self.device)
        slots = torch.tensor([s for r in requests for s in r.slots], device=self.device)
        self.cross_cache.write(slots, [(k[rows], v[rows]) for k, v in memory_kv], (src != self.pad_id)[rows])
        for r in requests:
            if r.params.beam_size > 1:
                r.beams = BeamState(r.params.beam_size, r.max_tokens, self.eos_id, r.params.length_penalty)

    def _last_tokens(self, r: Request) -> list[int]:
        """The token each of the request's rows feeds this step (the decoder's start token first)."""
        sequences = r.beams.sequences if r.beams is not None else [r.output_ids]
        return [s[-1] if s else self.start_id for s in sequences]

    def _decode(self, requests: list[Request], output: RunnerOutput) -> None:
        """One decoder step for every running sequence (each beam a row), then beams are reordered
        with one copy of the written prefix for all rows of the step that take another row's cache."""
        fed = {slot: (token, self._step_of(r)) for r in requests for slot, token in zip(r.slots, self._last_tokens(r), strict=True)}
        logits = self.decode_logits(fed, [r.slots for r in requests], max(len(r.prompt_ids) for r in requests))  # (R, V)
        suppress(logits, self.suppressed)  # once for the step's beams and streamed rows alike
        row_of = {slot: i for i, slot in enumerate(fed)}
        beams = [r for r in requests if r.beams is not None]
        streamed = [r for r in requests if r.beams is None]
        if beams:
            beam_rows = torch.tensor([row_of[s] for r in beams for s in r.slots], device=self.device)
            log_probs = F.log_softmax(logits.index_select(0, beam_rows).float(), dim=-1)  # (sum of K, V)
            states = [r.beams for r in beams if r.beams is not None]
            sources, targets = [], []
            for r, state, (parents, _) in zip(beams, states, step_beams(states, log_probs), strict=True):
                for beam, parent in enumerate(parents):
                    if parent != beam:  # this row takes its parent's cache; a row that continues itself keeps its own
                        sources.append(r.slots[parent])
                        targets.append(r.slots[beam])
                if state.done:
                    output.hypotheses[r.request_id] = state.best(r.params.n_best)
            if sources:
                written = max(position for _, position in fed.values()) + 1
                self.cache.copy_slots(torch.tensor(sources, device=self.device), torch.tensor(targets, device=self.device), written)
        if streamed:
            streamed_rows = torch.tensor([row_of[r.slots[0]] for r in streamed], device=self.device)
            sampled = _sample(logits.index_select(0, streamed_rows), streamed, self.eos_ids)
            output.tokens.update({r.request_id: t for r, t in zip(streamed, sampled, strict=True)})

    def decode_logits(self, fed: Fed, slots_of_requests: list[list[int]], source_length: int) -> Tensor:
        """Next-token logits (R, V) of one decoder step, a row per sequence of fed (slot -> (token,
        position)) in its order, suppressed ids not yet applied; source_length: the longest source.
        The fixed-shape step, or the dynamic one: it runs the span of cache rows `decode_rows`
        picks, idle rows included (as the generator's), so the caches are read through views, and
        when the rows are aligned blocks of one beam width (`beam_group`, from each request's
        slots), a sentence's beams read its cross-attention keys once."""
        if self.fixed_shape is not None:
            return self.fixed_shape(fed, source_length)
        step = decode_step(fed, self.max_len, self.pad_id, self.device)
        group = beam_group(slots_of_requests, step.rows)  # rows sharing a source: read its keys once
        memory_kv, src_mask = self.cross_cache.read(step.rows[::group], source_length)
        views = self.cache.views(step.rows, step.positions, step.length)
        logits = self.model.decode(step.ids, memory_kv, src_mask, step.positions, views, step.length, group)[:, -1]  # (rows, V)
        return logits.index_select(0, torch.tensor([step.row_of[s] for s in fed], device=self.device))

    @staticmethod
    def _step_of(r: Request) -> int:
        """Position of the token fed this step: the number of tokens generated so far."""
        return len(r.beams.sequences[0]) if r.beams is not None else len(r.output_ids)


def runner_for(model: Translator | Generator, tokenizer: TextTokenizer, n_slots: int, max_context: int | None = None) -> ModelRunner:
    if isinstance(model, Translator):
        return TranslatorRunner(model, tokenizer, n_slots, max_context)
    return GeneratorRunner(model, tokenizer, n_slots, max_context=max_context)
