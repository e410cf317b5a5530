"""Model runners: one step of tensors for the requests a plan names. Token ids in, token ids out."""

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from decoding.beam_search import BeamState, Hypothesis, step_beams
from decoding.sampling import adjust_logits, sample_next, suppress, suppressed_index
from decoding.translate import max_new_tokens_for, pad_batch
from loading.tokenizer import TextTokenizer
from model.generator import Generator
from model.kv_cache import CrossAttentionCache, PagedKVCache, SourceLayer, ragged_step
from model.translator import Translator
from service.engine.compile_cache import CompileCache, default_directory
from service.engine.compiled_decode import CompiledDecode
from service.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig, TokenLogprob, serving_context
from service.engine.fixed_shape import GeneratorDecoder, PagedFed, TranslatorDecoder
from service.engine.request import Request
from service.engine.scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    """What one execute() produced, by request id. A request of the plan is in exactly one of
    tokens (a streamed, greedy or sampled, sequence's next tokens: one, or with speculative
    decoding its drafts accepted and the token after them) and hypotheses (a beam search that
    ended this step, best first), or in neither (a beam search still running)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    hypotheses: dict[str, list[Hypothesis]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # the tokens', for requests that ask (GenerationParams)
    rejected: dict[str, int] = field(default_factory=dict)  # drafts refused (SchedulerOutput.drafts): their keys are discarded
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # at the prefill, for those that ask
    parents: dict[str, list[int]] = field(default_factory=dict)  # a beam search still running: beam b continues beam parents[b]
    prefill_seconds: float = 0.0  # the prompt / encoder pass of the plan's new requests


def prompt_ids(tokenizer: TextTokenizer, text: str, bos_id: int | None, eos_id: int) -> list[int]:
    """A prompt's ids: a generator's (bos_id given) with the special tokens its tokenizer puts
    before a prompt (a Llama's bos), bos alone for text without tokens (generation from nothing); a
    translator's source (bos_id None) ending with eos."""
    if bos_id is None:
        return tokenizer.encode(text) + [eos_id]
    return tokenizer.encode_prompt(text) or [bos_id]


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
    compiled: CompiledDecode | None  # its compiled decode steps (EngineConfig.compiled_decode), if any

    @property
    def bos_id(self) -> int | None:
        """A generator's; None for a translator, whose decoder starts from its own start id."""

    def max_new_tokens(self, prompt_length: int) -> int:
        """The most tokens a request with this prompt can generate before its slot is full."""

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt (generator) or source sentence (translator, ending with eos)."""

    def default_max_tokens(self, prompt_length: int) -> int:
        """The output length limit when a request sets none."""

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """One step: the plan's block copies (blocks_to_copy) before any key is written, the prefill of
        plan.prefill, then one token for every running sequence, its keys in its plan.block_tables."""

    @property
    def kv_cache_bytes(self) -> int: ...

    @property
    def kv_pool(self) -> "KVPool | None":
        """The paged KV cache's pool, whose blocks the engine's scheduler hands out (the plan carries
        each sequence's block table), or None: no paged KV, slots alone."""


def _sample(logits: Tensor, requests: list[Request], eos_ids: frozenset[int], drafted: list[list[int]] | None = None) -> list[int]:
    """Each row's next token from its row of logits (B, V), suppressed ids already at -inf: row i
    continues requests[i]'s output with drafted[i] (tokens proposed before it; default none),
    after that output's penalties and its logit bias, and with eos_ids at -inf before its
    min_tokens (on a copy: the logits stay as they are, for logprobs). A sampled row draws one
    uniform from its request's generator, in row order."""
    _seed(requests)
    outputs = [r.output_ids + d for r, d in zip(requests, drafted, strict=True)] if drafted else [r.output_ids for r in requests]
    adjusted = [i for i, r in enumerate(requests) if r.params.sampling.adjusts_logits]
    held = [i for i, (r, o) in enumerate(zip(requests, outputs, strict=True)) if len(o) < r.params.min_tokens]  # no eos yet
    if adjusted or held:
        logits = logits.float().clone()  # the caller's stay as they are
    if adjusted:
        index = torch.tensor(adjusted, device=logits.device)
        chosen = [requests[i] for i in adjusted]
        rows = adjust_logits(
            logits.index_select(0, index),
            [r.params.sampling for r in chosen],
            [r.prompt_ids for r in chosen],
            [outputs[i] for i in adjusted],
        )
        logits = logits.index_copy(0, index, rows)
    if held:
        eos = torch.tensor(sorted(eos_ids), device=logits.device)
        logits[torch.tensor(held, device=logits.device)[:, None], eos[None]] = float("-inf")
    return sample_next(logits, [r.params.sampling for r in requests], [r.rng for r in requests]).tolist()


def _seed(requests: list[Request]) -> None:
    """A generator for each sampled request that has none: from its seed, or a random one."""
    for r in requests:
        if r.rng is None and not r.params.sampling.greedy:
            seed = r.params.sampling.seed if r.params.sampling.seed is not None else secrets.randbits(63)
            r.rng = torch.Generator().manual_seed(seed)


def _verify(logits: Tensor, requests: list[Request], drafts: list[list[int]], eos_ids: frozenset[int]) -> list[list[int]]:
    """Speculative decoding's verification: each request's tokens from its 1 + len(drafts[i])
    consecutive rows of logits (R, V), row j continuing its output with its first j drafts. Each
    row is sampled as a plain step would sample it (`_sample`, a uniform each from the request's
    generator); the drafts are kept while each equals what its row drew, and the first row that
    draws otherwise gives the last token. A request's generator is then left as if it had drawn
    once per token kept: the tokens are those of decoding one at a time, seed for seed (and so
    distributed as the model's: the rejection sampling of a draft that is a single token)."""
    _seed(requests)
    states = [r.rng.get_state() if r.rng is not None else None for r in requests]
    rows = [(r, d[:j]) for r, d in zip(requests, drafts, strict=True) for j in range(len(d) + 1)]
    tokens = _kept(_sample(logits, [r for r, _ in rows], eos_ids, [d for _, d in rows]), drafts, eos_ids)
    for r, d, state, kept in zip(requests, drafts, states, tokens, strict=True):
        if len(kept) <= len(d) and r.rng is not None and state is not None:  # drew len(d) + 1: as if len(kept)
            r.rng.set_state(state)
            torch.rand(len(kept), generator=r.rng)
    return tokens


def _kept(drawn: list[int], drafts: list[list[int]], eos_ids: frozenset[int]) -> list[list[int]]:
    """Each request's tokens from its 1 + len(drafts[i]) consecutive draws (drawn, in order): its
    drafts while each equals the draw of the row before it (and is no eos), then the next draw."""
    tokens, at = [], 0
    for d in drafts:
        taken = 0
        while taken < len(d) and drawn[at + taken] == d[taken] and d[taken] not in eos_ids:
            taken += 1
        tokens.append(drawn[at : at + taken + 1])
        at += len(d) + 1
    return tokens


def _argmax_only(r: Request) -> bool:
    """r's next tokens are its logits' argmax and it asks nothing else of them: greedy, no logprobs,
    penalties, bias, grammar, or eos held back (min_tokens)."""
    p = r.params
    return (
        p.sampling.greedy
        and p.logprobs is None
        and not p.sampling.adjusts_logits
        and r.grammar is None
        and len(r.output_ids) >= p.min_tokens
    )


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its token under logits (R, V), with the `top` most likely."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (R, V)
    chosen = log_probs.gather(1, torch.tensor(tokens, dtype=torch.long, device=logits.device).unsqueeze(1))[:, 0].tolist()  # (R,)
    best, best_ids = log_probs.topk(top, dim=-1) if top else (log_probs[:, :0], log_probs[:, :0].long())  # (R, top)
    return [
        TokenLogprob(token, logprob, tuple(zip(ids, values, strict=True)))
        for token, logprob, ids, values in zip(tokens, chosen, best_ids.tolist(), best.tolist(), strict=True)
    ]


def record_logprobs(output: RunnerOutput, logits: Tensor, tokens: list[list[int]], requests: list[Request], widths: list[int]) -> None:
    """The sampled tokens' logprobs (logits (R, V), as sampled from: widths[i] rows for
    requests[i], its tokens[i] from its first rows) of the requests that ask."""
    at = 0
    for r, chosen, width in zip(requests, tokens, widths, strict=True):
        if r.params.logprobs is not None:
            output.logprobs[r.request_id] = token_logprobs(logits[at : at + len(chosen)], chosen, r.params.logprobs)
        at += width


@dataclass(frozen=True)
class KVPool:
    """A paged runner's pool, as the engine's Scheduler hands it out: block 0 is the null block."""

    num_blocks: int
    block_size: int
    prefix_caching: bool
    salt: str  # in every block hash: the model (its shape and weights' identity)
    encoder_decoder: bool  # the blocks hold a decoder's tokens, a sequence per row (a source is not in them); else prompts too


def kv_pool_blocks(config: EngineConfig, context: int, block_bytes: int, block_size: int, device: torch.device) -> int:
    """Blocks the pool gets (the null block included) from the config's memory budget; ValueError
    when they cannot hold one sequence of the whole serving context."""
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    elif config.kv_cache_memory_fraction is not None and device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * config.kv_cache_memory_fraction)
    else:
        whole = -(-context // block_size) * block_bytes
        budget = max(min(config.n_slots * whole, DEFAULT_KV_CACHE_BYTES), whole)
    blocks = budget // block_bytes
    needed = -(-context // block_size)
    if blocks < needed:
        raise ValueError(
            f"the KV cache budget ({budget} bytes: {blocks * block_size} tokens) cannot hold one sequence of the "
            f"serving context ({context} tokens); raise kv_cache_bytes or lower max_context"
        )
    return blocks + 1


@dataclass(frozen=True)
class StepRows:
    """A step's rows whose logits are needed: logits (R, V), or final hidden states (R, d) that
    `project` turns into logits a block of rows at a time."""

    values: Tensor
    project: Callable[[Tensor], Tensor] | None = None

    def logits(self, a: int, b: int) -> Tensor:
        """Logits (b - a, V) of rows [a, b) (a new tensor where projected, else a view)."""
        return self.values[a:b] if self.project is None else self.project(self.values[a:b])


# A sampling block's logits fit in a server CPU's last-level cache: 64 rows of a 49,152-token
# vocabulary (a 256-row step's 50 MB do not, and cost 1.7x per row: docs/performance.md).
LOGITS_BLOCK_BYTES = 12 << 20


class GeneratorRunner:
    """Decoder-only, over paged KV: each step computes the scheduled tokens of every sequence
    (prompt chunks and one-token decodes alike) as one ragged batch (model/kv_cache.py
    ragged_step), then samples for the sequences whose tokens are all computed."""

    def __init__(
        self,
        model: Generator,
        tokenizer: TextTokenizer,
        config: EngineConfig,
        fixed_shape_decode: bool | None = None,
    ) -> None:
        """config: the pool's size and blocks, the serving context (EngineConfig). fixed_shape_decode:
        decode-only steps through fixed-shape steps by bucket, CUDA graphs on a GPU
        (service/engine/fixed_shape.py; default: on CUDA devices, eager on others)."""
        c = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.max_len = serving_context(config.max_context, c.max_len)  # prompt + output
        block_bytes = PagedKVCache.block_bytes(c.n_layers, config.block_size, c.kv_heads, c.head_dim, dtype)
        num_blocks = kv_pool_blocks(config, self.max_len, block_bytes, config.block_size, self.device)
        self.cache = PagedKVCache(c.n_layers, num_blocks, config.block_size, c.kv_heads, c.head_dim, self.device, dtype)
        salt = f"{type(model).__name__}:{c}:{id(model)}"  # one pool per model object: the salt keeps the hashes apart regardless
        self.kv_pool = KVPool(num_blocks, config.block_size, config.prefix_caching, salt, encoder_decoder=False)
        self.max_prompt_len = self.max_len - 1
        self.bos_id, self.eos_id, self.pad_id = c.bos_id, c.eos_id, c.pad_id
        self.eos_ids = frozenset(c.eos_ids)
        self.suppressed = suppressed_index(c.suppressed_ids, self.device)
        self.strip_leading_space = False  # a play's text keeps its layout
        # Rows sampled together (_sample_blocks): all of them on a GPU, whose step is one launch per block.
        self.block_rows = max(1, LOGITS_BLOCK_BYTES // (4 * c.vocab_size)) if self.device.type == "cpu" else 1 << 30
        if fixed_shape_decode is None:
            fixed_shape_decode = self.device.type == "cuda"
        capture = self.device.type == "cuda"
        self.fixed_shape = GeneratorDecoder(model, self.cache, config.n_slots, self.max_len, capture) if fixed_shape_decode else None
        compiled = config.compiled_decode and not fixed_shape_decode
        self.compiled = compiled_decode(model, self.cache, config, None) if compiled else None

    def max_new_tokens(self, prompt_length: int) -> int:
        return self.max_len - prompt_length

    def encode_prompt(self, text: str) -> list[int]:
        return prompt_ids(self.tokenizer, text, self.bos_id, self.eos_id)

    def default_max_tokens(self, prompt_length: int) -> int:
        return self.max_new_tokens(prompt_length)

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Computes plan.num_tokens[r] tokens of each scheduled request from its
        num_computed_tokens, and samples the next token of those whose tokens are then all computed."""
        output = RunnerOutput()
        requests = plan.decode + plan.prefill
        if not requests:
            return output
        started = time.perf_counter()
        counts = [plan.num_tokens[r.request_id] for r in requests]
        starts = [r.num_computed_tokens for r in requests]
        drafts = [plan.drafts.get(r.request_id, []) for r in requests]
        # Each one's tokens this step (its drafts after its own), and whether they are then all computed: it samples.
        tokens = [r.tokens_at(s, n - len(d)) + d for r, s, n, d in zip(requests, starts, counts, drafts, strict=True)]
        done = [s + n - len(d) == r.num_tokens for r, s, n, d in zip(requests, starts, counts, drafts, strict=True)]
        # Rows whose logits are needed: every row of a prompt chunk that is scored, else the last of each
        # request that samples and a row before each of its drafts.
        scored = [r.params.prompt_logprobs is not None and not r.output_ids for r in requests]
        rows: list[int] = []
        first = 0
        for n, d, sc, dr in zip(counts, done, scored, drafts, strict=True):
            rows += list(range(first, first + n)) if sc else list(range(first + n - 1 - len(dr), first + n)) if d else []
            first += n
        if all(n == 1 for n in counts) and len(rows) == len(requests):  # decodes only
            fed = {r.slots[0]: (t[0], s, plan.block_tables[r.request_id]) for r, t, s in zip(requests, tokens, starts, strict=True)}
            step_rows = self.decode_rows(fed)  # in requests' order
        else:
            ids = torch.tensor([i for t in tokens for i in t], device=self.device)
            positions_list = [p for s, n in zip(starts, counts, strict=True) for p in range(s, s + n)]
            tables = [plan.block_tables[r.request_id] for r in requests]
            compiled = None
            if self.compiled is not None and not plan.prefill and len(rows) == len(positions_list):  # verifications only
                compiled = self.compiled(ids, positions_list, [t for t, n in zip(tables, counts, strict=True) for _ in range(n)])
            if compiled is not None:  # each row a decode of its own, after the rows before it (their keys written first)
                step_rows = StepRows(compiled)
            else:
                step = ragged_step(counts, starts, tables, self.cache.block_size, self.device, self.model.positions.alibi_slopes)
                positions = torch.tensor(positions_list, device=self.device)
                logit_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
                step_rows = StepRows(self.model.hidden_ragged(ids, positions, self.cache.layers(step), logit_rows), self.model.logits)
        if any(scored):
            scored_rows = step_rows.logits(0, len(rows))
            sampling, next_logits = self._score_prompts(output, requests, counts, starts, done, scored, plan.drafts, scored_rows)
            self._sample_blocks(plan, sampling, lambda a, b: next_logits[a:b], output)
        else:  # the rows of each sampling request, in order: logits a block of rows at a time
            sampling = [r for r, d in zip(requests, done, strict=True) if d]
            if not self._take_argmax(plan, sampling, step_rows, output):
                self._sample_blocks(plan, sampling, lambda a, b: suppress(step_rows.logits(a, b), self.suppressed), output)
        if plan.prefill:
            output.prefill_seconds = time.perf_counter() - started
        return output

    def _score_prompts(
        self,
        output: RunnerOutput,
        requests: list[Request],
        counts: list[int],
        starts: list[int],
        done: list[bool],
        scored: list[bool],
        drafts: dict[str, list[int]],
        logits: Tensor,
    ) -> tuple[list[Request], Tensor]:
        """A step with prompts scored (prompt_logprobs): logits (rows, V) of every row of each scored
        chunk and those of each other request that samples (its last, and one before each of its
        drafts). Records the prompts' logprobs; returns the requests that sample and their rows of
        logits (S, V), in order."""
        suppress(logits, self.suppressed)
        at = 0
        sampling, sampled_rows = [], []
        for r, n, s, d, sc in zip(requests, counts, starts, done, scored, strict=True):
            if sc:
                prompt = r.prompt_ids
                scoring = min(n, len(prompt) - 1 - s)  # row p scores prompt token p + 1
                if scoring > 0:
                    top = r.params.prompt_logprobs or 0
                    r.prompt_logprobs_so_far += token_logprobs(logits[at : at + scoring], prompt[s + 1 : s + 1 + scoring], top)
                if d:
                    output.prompt_logprobs[r.request_id] = [TokenLogprob(prompt[0], None), *r.prompt_logprobs_so_far]
                at += n
                if d:
                    sampling.append(r)
                    sampled_rows.append(at - 1)
            elif d:
                width = 1 + len(drafts.get(r.request_id, ()))
                sampling.append(r)
                sampled_rows += range(at, at + width)
                at += width
        return sampling, in_order(logits, sampled_rows)  # (S, V)

    def _take_argmax(self, plan: SchedulerOutput, sampling: list[Request], step_rows: StepRows, output: RunnerOutput) -> bool:
        """A step whose sampling requests are all `_argmax_only`, over hidden states the panel kernel
        projects: their tokens from each row's argmax without the logits (Generator.greedy_ids),
        drafts kept as `_verify` keeps them. False, having done nothing, where that does not apply."""
        if step_rows.project is None or self.suppressed is not None or plan.grammar is not None or not sampling:
            return False
        if not all(_argmax_only(r) for r in sampling):
            return False
        ids = self.model.greedy_ids(step_rows.values)  # (R,): the rows of every sampling request, in order
        if ids is None:
            return False
        drafts = [plan.drafts.get(r.request_id, []) for r in sampling]
        for r, d, kept in zip(sampling, drafts, _kept(ids.tolist(), drafts, self.eos_ids), strict=True):
            output.tokens[r.request_id] = kept
            if d:
                output.rejected[r.request_id] = len(d) + 1 - len(kept)
        return True

    def _sample_blocks(
        self, plan: SchedulerOutput, sampling: list[Request], logits_of: Callable[[int, int], Tensor], output: RunnerOutput
    ) -> None:
        """Samples each of `sampling` from its rows of logits_of(a, b) (rows [a, b), suppressed ids at
        -inf: one, or with drafts one before each and the last, `_verify`), about block_rows rows at
        a time: a block's logits are projected, masked by the grammars, sampled and scored while
        they are in the CPU's cache (a 256-row step's whole logits are not)."""
        widths = [1 + len(plan.drafts.get(r.request_id, ())) for r in sampling]
        first = row = 0
        while first < len(sampling):
            last, rows = first + 1, widths[first]
            while last < len(sampling) and rows + widths[last] <= self.block_rows:
                rows += widths[last]
                last += 1
            requests, block_widths = sampling[first:last], widths[first:last]
            logits = logits_of(row, row + rows)  # (rows, V)
            if plan.grammar is not None:  # a row each, and one per draft: the grammar's masks after the drafts before it
                plan.grammar.apply(logits, [r.request_id for r, width in zip(requests, block_widths, strict=True) for _ in range(width)])
            if rows == len(requests):
                chosen = [[t] for t in _sample(logits, requests, self.eos_ids)]
            else:
                chosen = _verify(logits, requests, [plan.drafts.get(r.request_id, []) for r in requests], self.eos_ids)
                for r, width, taken in zip(requests, block_widths, chosen, strict=True):
                    if width > 1:
                        output.rejected[r.request_id] = width - len(taken)
            output.tokens.update({r.request_id: t for r, t in zip(requests, chosen, strict=True)})
            record_logprobs(output, logits, chosen, requests, block_widths)
            first, row = last, row + rows

    def decode_rows(self, fed: PagedFed) -> StepRows:
        """The rows of a step of one token per sequence, a row per sequence of fed (slot -> (token,
        position, block table)) in its order: logits from the fixed-shape step or the compiled one
        (at the batch sizes it runs), else the ragged step's hidden states, projected when read."""
        if self.fixed_shape is not None:
            return StepRows(self.fixed_shape(fed))
        ids_list, positions_list, tables = (list(column) for column in zip(*fed.values(), strict=True))
        ids = torch.tensor(ids_list, device=self.device)
        compiled = self.compiled(ids, positions_list, tables) if self.compiled is not None else None
        if compiled is not None:
            return StepRows(compiled)
        step = ragged_step([1] * len(fed), positions_list, tables, self.cache.block_size, self.device, self.model.positions.alibi_slopes)
        positions = torch.tensor(positions_list, device=self.device)
        rows = torch.arange(len(fed), device=self.device)
        return StepRows(self.model.hidden_ragged(ids, positions, self.cache.layers(step), rows), self.model.logits)


def in_order(logits: Tensor, rows: list[int]) -> Tensor:
    """logits' rows (R, V) in the order `rows` names them: logits itself where that is all of them in
    order (so a change in place changes logits too), else a copy (a vocabulary-wide row each, so
    worth sparing)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows, device=logits.device))


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
        block_size: int = EngineConfig.block_size,
        encoded_ahead_tokens: int = 2 * EngineConfig.max_num_batched_tokens,
        config: EngineConfig | None = None,
    ) -> None:
        """max_context: EngineConfig.max_context (None: its default), the length of the source
        (cross-attention) and target caches. fixed_shape_decode: as GeneratorRunner's.
        config: its compiled_decode (where the CPU kernel reads the sources), compile_in_background
        and compile_cache (the other sizes are the arguments before). The
        decoder's self-attention keys are paged: blocks of block_size tokens, a pool (kv_pool) that
        holds every slot's whole context and a block per slot for beam forks, so that a step never
        waits for one; the engine's scheduler hands them out, a row (slot) a sequence, and forks a
        beam that continues another (its full blocks shared, its last copied: the plan's blocks_to_copy).
        encoded_ahead_tokens: the most source tokens whose cross-attention keys and values are kept
        for requests still waiting (encoded with an earlier step's sources: `_encode`); 0: none."""
        c = model.config
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        n_layers = len(model.decoder_layers)
        self.max_len = serving_context(max_context, c.max_len)
        num_blocks = n_slots * (-(-self.max_len // block_size) + 1) + 1  # + the null block
        self.cache = PagedKVCache(n_layers, num_blocks, block_size, c.n_heads, c.head_dim, self.device, dtype)
        self.kv_pool = KVPool(num_blocks, block_size, prefix_caching=False, salt="", encoder_decoder=True)  # a sequence per row
        self.cross_cache = CrossAttentionCache(n_layers, n_slots, c.n_heads, self.max_len, c.head_dim, self.device, dtype)
        self.max_prompt_len = self.max_len
        self.start_id, self.eos_id, self.pad_id = c.start_id, c.eos_id, c.pad_id
        self.bos_id: int | None = None
        self.eos_ids = frozenset(c.eos_ids)
        self.suppressed = suppressed_index(c.suppressed_ids, self.device)
        self.strip_leading_space = True  # sentence tokenizers start a sentence with a word-boundary space
        self.ragged_encode = model.positions.alibi_slopes is None  # new sources side by side (ALiBi's biases: padded)
        # Request id -> its source's cross-attention keys and values, per layer ((S, H, D) each), for
        # requests still waiting whose sources were encoded ahead.
        self.encoded_ahead: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self.encoded_ahead_tokens = encoded_ahead_tokens
        if fixed_shape_decode is None:
            fixed_shape_decode = self.device.type == "cuda"
        capture = self.device.type == "cuda"
        self.fixed_shape = TranslatorDecoder(model, self.cache, self.cross_cache, capture) if fixed_shape_decode else None
        config = config or EngineConfig(n_slots=n_slots)
        compiled = config.compiled_decode and not fixed_shape_decode and self.cross_cache.decode_kernel
        self.compiled = compiled_decode(model, self.cache, config, self.cross_cache) if compiled else None

    def max_new_tokens(self, prompt_length: int) -> int:
        return self.max_len - 1  # position 0 holds the start token

    def encode_prompt(self, text: str) -> list[int]:
        return prompt_ids(self.tokenizer, text, self.bos_id, self.eos_id)

    def default_max_tokens(self, prompt_length: int) -> int:
        return max_new_tokens_for(prompt_length, self.max_len)

    @property
    def kv_cache_bytes(self) -> int:
        return self.cache.nbytes + self.cross_cache.nbytes

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """The plan's block copies (beam forks of the step before: before any key is written), the
        new sources' encoder pass, then a decoder step for every running row (`_decode`)."""
        if plan.blocks_to_copy:
            self.cache.copy_blocks(*(torch.tensor(column) for column in zip(*plan.blocks_to_copy, strict=True)))
        output = RunnerOutput()
        if plan.prefill:
            started = time.perf_counter()
            self._encode(plan.prefill, plan.upcoming)
            self._start_beams(plan.prefill)
            output.prefill_seconds = time.perf_counter() - started
        self._decode(plan, output)
        return output

    def _encode(self, requests: list[Request], upcoming: list[Request]) -> None:
        """The admitted requests' cross-attention keys and values written to their slots (each beam
        row its own copy of its sentence's, or its first row alone: `_source_slots`). Sources
        encoded ahead are taken as they are; the others go through the encoder together, and with
        them, up to encoded_ahead_tokens, the upcoming requests' (still waiting, next in line):
        their keys are kept for the step that admits them, so that the encoder runs once for
        several steps' sources, in a batch of many rows. Kept keys of a request no longer upcoming
        (it ended while waiting) go at the next admission."""
        kept = [r for r in requests if r.request_id in self.encoded_ahead]
        fresh = [r for r in requests if r.request_id not in self.encoded_ahead]
        if kept:  # their keys, one request after another
            layers = zip(*(self.encoded_ahead.pop(r.request_id) for r in kept), strict=True)  # per layer, each request's (k, v)
            kept_kv = [(torch.cat([k for k, _ in layer]), torch.cat([v for _, v in layer])) for layer in layers]  # (N, H, D)
            self.cross_cache.write([self._source_slots(r) for r in kept], [len(r.prompt_ids) for r in kept], kept_kv)
        next_in_line = {r.request_id for r in upcoming}
        for stale in [i for i in self.encoded_ahead if i not in next_in_line]:  # ended while waiting, or no longer next
            del self.encoded_ahead[stale]
        if not fresh:
            return
        ahead = []
        room = self.encoded_ahead_tokens - sum(kv[0][0].shape[0] for kv in self.encoded_ahead.values())
        for r in upcoming:
            if r.request_id not in self.encoded_ahead and len(r.prompt_ids) <= room:
                ahead.append(r)
                room -= len(r.prompt_ids)
        memory_kv = self._encode_sources([r.prompt_ids for r in fresh + ahead])  # per layer (N, H, D) each
        first = sum(len(r.prompt_ids) for r in fresh)  # the fresh sources' tokens come first
        lengths = [len(r.prompt_ids) for r in fresh]
        self.cross_cache.write([self._source_slots(r) for r in fresh], lengths, [(k[:first], v[:first]) for k, v in memory_kv])
        for r in ahead:  # copies: the step's batch is not kept for them
            n = len(r.prompt_ids)
            self.encoded_ahead[r.request_id] = [(k[first : first + n].clone(), v[first : first + n].clone()) for k, v in memory_kv]
            first += n

    @property
    def reads_sources_in_place(self) -> bool:
        """Whether decoder steps read each row's source keys where they lie, through the CPU
        kernel (`step_logits`), a sentence's beams all from its first slot's copy; else (the
        fixed-shape step, SDPA) each row reads its own copy."""
        return self.fixed_shape is None and self.cross_cache.decode_kernel

    def _source_slots(self, r: Request) -> list[int]:
        """The request's slots that hold a copy of its source's keys: its first alone where
        sources are read in place, else every beam's."""
        return r.slots[:1] if self.reads_sources_in_place else r.slots

    def _start_beams(self, requests: list[Request]) -> None:
        """Each admitted beam search's state."""
        for r in requests:
            if r.params.beam_size > 1:
                r.beams = BeamState(r.params.beam_size, r.max_tokens, self.eos_id, r.params.length_penalty)

    def _encode_sources(self, sources: list[list[int]]) -> list[tuple[Tensor, Tensor]]:
        """Each decoder layer's cross-attention keys and values of the sources, (N, H, D) each, the
        sources' tokens one after another: the sources side by side, without padding
        (ragged_encode), else padded to the longest."""
        if self.ragged_encode:
            ids = torch.tensor([t for s in sources for t in s], device=self.device)  # (N,)
            memory = self.model.encode_ragged(ids, [len(s) for s in sources])  # (1, N, d)
            return [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v in self.model.cross_key_values(memory)]  # (N, H, D)
        src = pad_batch(sources, self.pad_id).to(self.device)  # (B, S)
        real = src != self.pad_id  # (B, S)
        return [(k.transpose(1, 2)[real], v.transpose(1, 2)[real]) for k, v in self.model.cross_key_values(self.model.encode(src))]

    @staticmethod
    def _rows_of(r: Request) -> list[int]:
        """The request's slots that take this step's decoder pass: a streamed sequence's one; a beam
        search's every beam, but at its first step the first only (every beam starts from the start
        token, and only the first is expanded: BeamState)."""
        return r.slots if r.beams is not None and r.beams.sequences[0] else r.slots[:1]

    def _last_tokens(self, r: Request) -> list[int]:
        """The token each of the request's fed rows (`_rows_of`) feeds this step (the decoder's start token first)."""
        sequences = r.beams.sequences if r.beams is not None else [r.output_ids]
        return [s[-1] if s else self.start_id for s in sequences[: len(self._rows_of(r))]]

    def _decode(self, plan: SchedulerOutput, output: RunnerOutput) -> None:
        """One decoder step for every running sequence (each beam a row, but a beam search's first
        step), each row's token at position num_computed_tokens in the blocks of its table in the
        plan; a beam search still running reports its beams' parents (the engine forks their blocks)."""
        requests = plan.prefill + plan.decode
        fed = {
            slot: (token, r.num_computed_tokens, plan.block_tables[str(slot)])
            for r in requests
            for slot, token in zip(self._rows_of(r), self._last_tokens(r), strict=True)
        }
        logits, fed_rows = self.step_logits(fed, [r.slots for r in requests], max(len(r.prompt_ids) for r in requests))  # (N, V)
        suppress(logits, self.suppressed)  # once for the step's beams and streamed rows alike
        row_of = dict(zip(fed, fed_rows, strict=True))
        beams = [r for r in requests if r.beams is not None]
        streamed = [r for r in requests if r.beams is None]
        if beams:
            # (sum of K,): each beam's row, read in place, not copied; at a first step, the first beam's for all
            beam_rows = torch.tensor([row_of[s] if s in row_of else row_of[r.slots[0]] for r in beams for s in r.slots])
            states = [r.beams for r in beams if r.beams is not None]
            for r, state, (parents, _) in zip(beams, states, step_beams(states, logits, beam_rows), strict=True):
                if state.done:
                    output.hypotheses[r.request_id] = state.best(r.params.n_best)
                else:
                    output.parents[r.request_id] = parents
        if streamed:
            streamed_logits = in_order(logits, [row_of[r.slots[0]] for r in streamed])  # (S, V)
            if plan.grammar is not None:
                plan.grammar.apply(streamed_logits, [r.request_id for r in streamed])
            sampled = _sample(streamed_logits, streamed, self.eos_ids)
            output.tokens.update({r.request_id: [t] for r, t in zip(streamed, sampled, strict=True)})

    def step_logits(self, fed: PagedFed, slots_of_requests: list[list[int]], source_length: int) -> tuple[Tensor, list[int]]:
        """Next-token logits (N, V) of one decoder step, and the row of each sequence of fed (slot ->
        (token, position, block table: its blocks hold it)) among them, in fed's order; suppressed ids
        not yet applied; source_length: the longest source. The fixed-shape step (rows in fed's
        order), or the dynamic one. There, with the CPU kernel, the rows are fed's, in order, and
        each reads its source keys in place (a sentence's beams all from its first slot's copy,
        which stays in the CPU's caches between them); else the step runs the span of rows
        `decode_rows` picks, idle rows included (at position 0 of the null block), reading the
        sources through views of the cross cache, where a sentence's beams read its keys once
        when the rows are aligned blocks of one beam width (`beam_group`, from each request's slots).
        With the CPU kernel, a step of as many rows as a batch size the compiled step runs (CompiledDecode) runs through its graph."""
        if self.fixed_shape is not None:
            return self.fixed_shape(fed, source_length), list(range(len(fed)))
        memory_kv: list[tuple[Tensor, Tensor]] | list[SourceLayer]
        sources = None
        if self.reads_sources_in_place:  # each row's source keys read in place by the CPU kernel
            rows = list(fed)  # in fed's order, no idle rows: every cache is read through tables
            first = {slot: slots[0] for slots in slots_of_requests for slot in slots}  # a sentence's beams read one copy
            sources = self.cross_cache.sources([first[row] for row in rows])
            group, memory_kv, src_mask = 1, self.cross_cache.bound(*sources), None
        else:
            rows = decode_rows(list(fed))
            group = beam_group(slots_of_requests, rows)  # rows sharing a source: read its keys once
            memory_kv, src_mask = self.cross_cache.read(rows[::group], source_length)
        idle: tuple[int, int, list[int]] = (self.pad_id, 0, [])
        ids, positions, tables = (list(column) for column in zip(*(fed.get(row, idle) for row in rows), strict=True))
        ids_tensor = torch.tensor(ids, device=self.device)  # (rows,)
        logits = self.compiled(ids_tensor, positions, tables, sources) if self.compiled is not None else None  # (rows, V)
        if logits is None:
            step = ragged_step([1] * len(rows), positions, tables, self.cache.block_size, self.device, self.model.positions.alibi_slopes)
            positions_tensor = torch.tensor(positions, device=self.device)
            layers = self.cache.layers(step)
            logits = self.model.decode(ids_tensor[:, None], memory_kv, src_mask, positions_tensor[:, None], layers, 0, group)[:, -1]
        row_of = {row: i for i, row in enumerate(rows)}
        return logits, [row_of[s] for s in fed]


def compiled_decode(
    model: Generator | Translator, cache: PagedKVCache, config: EngineConfig, sources: CrossAttentionCache | None
) -> CompiledDecode:
    """The config's compiled decode steps (compiled_decode, compile_in_background, compile_cache)."""
    store = CompileCache(default_directory()) if config.compile_cache else None
    return CompiledDecode(model, cache, config.compiled_decode, sources, store, config.compile_in_background)


def runner_for(model: Translator | Generator, tokenizer: TextTokenizer, config: EngineConfig) -> ModelRunner:
    if isinstance(model, Translator):
        return TranslatorRunner(
            model,
            tokenizer,
            config.n_slots,
            config.max_context,
            block_size=config.block_size,
            encoded_ahead_tokens=2 * config.max_num_batched_tokens,
            config=config,
        )
    return GeneratorRunner(model, tokenizer, config)
