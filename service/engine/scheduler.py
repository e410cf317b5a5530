"""Which requests run this step, and their KV blocks (vLLM v1's scheduler: the scheduler owns the
blocks, the runner reads the tables the plan carries). Holds no tensors: a waiting queue, a running
set, a slot allocator, a block manager and a per-step token budget, for every kind of model:

- decoder-only (paged prompts): a request's prompt and output tokens go in its blocks, the prompt
  computed in chunks and shared by prefix, a request preempted when blocks run out;
- encoder-decoder: a request's source is encoded whole when it is admitted, and each of its rows
  (a slot: each beam one) is a sequence of decoder tokens, id str(slot), in the blocks; a beam
  search's reordering forks rows (`fork`), the block copies that makes carried in the next plan;
- a runner without paged KV (kv_pool None: the tests' FakeRunner): as an encoder-decoder, slots alone.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.engine.config import BatchingPolicy, FinishReason
from service.engine.errors import QueueFullError
from service.engine.kv_blocks import KVBlockManager
from service.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from service.engine.grammar import GrammarMasks


class SlotAllocator:
    """Free rows of the KV cache. Lowest free rows first, so a lightly loaded engine reuses the same rows."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self._free = list(range(n_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n rows, or None when fewer are free (the request stays waiting)."""
        if n > len(self._free):
            return None
        self._free.sort()
        rows, self._free = self._free[:n], self._free[n:]
        return rows

    def free(self, rows: list[int]) -> None:
        assert not set(rows) & set(self._free), "slot freed twice"
        self._free.extend(rows)


@dataclass
class SchedulerOutput:
    """The plan of one step."""

    prefill: list[Request] = field(default_factory=list)  # admitted now: prompt / encoder pass, then their first token
    decode: list[Request] = field(default_factory=list)  # already running: one more token each
    aborted: list[Request] = field(default_factory=list)  # removed at the start of this step; their slots are free
    timed_out: list[Request] = field(default_factory=list)  # past a deadline at the start of this step; slots free
    # Tokens each request computes this step from its num_computed_tokens (an encoder-decoder's: 1,
    # each row's next decoder token), and each sequence's blocks (a copy; by sequence id: a
    # decoder-only request's id, an encoder-decoder row's str(slot)).
    num_tokens: dict[str, int] = field(default_factory=dict)
    # Decoder-only: a decode's proposed tokens (speculative decoding), computed after its last
    # token and counted in its num_tokens; the keys of those the sampler refuses are discarded.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # (source block, destination block, tokens): the first tokens of source copied to destination
    # (beam forks of the step before), by the runner before the step writes any key.
    blocks_to_copy: list[tuple[int, int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # decoder-only: blocks freed, back to waiting
    # Encoder-decoder (or slots alone), with admissions: the waiting requests next in line whose
    # sources fit in the step's budget left (the runner encodes their sources with this step's: TranslatorRunner).
    upcoming: list[Request] = field(default_factory=list)
    grammar: "GrammarMasks | None" = None  # the token masks of its requests with a structured output (the engine's)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def batch_size(self) -> int:
        return len(self.prefill) + len(self.decode)


class Scheduler:
    """Admission by free slots, free blocks and a per-step budget of max_num_batched_tokens tokens
    computed (vLLM's); a bounded waiting queue; first come, first served (no overtaking).

    Decoder-only (vLLM's v1 scheduler): running decodes are scheduled first (one token each), then
    running prompts' next chunks, then waiting requests, admitted by free blocks (after their cached
    prefix) while fewer than n_slots sequences run. A request whose next blocks cannot be had
    preempts the latest-admitted running request (blocks freed, tokens kept, back to the front of
    the queue: recomputed when readmitted). A request computes tokens [num_computed_tokens, +
    num_tokens) of prompt_ids + output_ids; its full blocks are registered in the prefix cache when
    scheduled: a step writes every new key before any sequence reads one, so a request admitted in
    the same step (n > 1, one system prompt) shares them at once.

    Encoder-decoder: every running request decodes (each row a token: one of the budget), then
    waiting requests are admitted by free slots (beam_size each) while their sources' tokens and
    first row fit in what is left (the step's first admission needs only some left: a source is
    never split). num_computed_tokens counts each row's decoder tokens; each row holds blocks for
    one more before the step (the pool holds every row's whole context and a block for a fork).

    policy "continuous" admits between any two decode steps; "static" (request-level batching,
    for comparison) admits only when the running batch has drained.
    """

    def __init__(
        self,
        n_slots: int,
        max_waiting: int,
        max_num_batched_tokens: int,
        policy: BatchingPolicy = "continuous",
        queue_timeout_s: float | None = None,
        request_timeout_s: float | None = None,
        blocks: KVBlockManager | None = None,
        decoder_only: bool = False,
        speculation_max_batch: int = 0,
    ) -> None:
        """queue_timeout_s: the longest a request may wait for admission; request_timeout_s: the
        longest from arrival to its last token. Past either, it ends with reason "timeout".
        blocks: the KV pool's (None: slots alone); decoder_only: they hold prompts (needs blocks).
        speculation_max_batch: decodes verify their requests' draft_ids in a step of at most this
        many decodes (decoder-only; budget allowing), else decode their one token.
        The waiting queue holds at most max_waiting requests, and tokens (each request's prompt
        and max_tokens) up to waiting_token_budget, which the engine sets from its KV pool and
        measured speed (Engine.waiting_token_budget); a first waiting request is always taken."""
        assert blocks is not None or not decoder_only, "a decoder-only model's prompts go in blocks"
        self.slots = SlotAllocator(n_slots)
        self.blocks, self.decoder_only = blocks, decoder_only
        self.max_waiting = max_waiting
        self.waiting_token_budget: int | None = None  # None: no bound by tokens
        self.waiting_tokens = 0  # of the requests in `waiting`; read by other threads (an int: no lock)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speculation_max_batch = speculation_max_batch
        self.policy = policy
        self.queue_timeout_s, self.request_timeout_s = queue_timeout_s, request_timeout_s
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self._abort_requested: set[str] = set()
        self._copies: dict[str, list[tuple[int, int, int]]] = {}  # by request: its forks' copies, for the next plan

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._abort_requested)

    def add(self, request: Request) -> None:
        """Queues the request; raises QueueFullError when the waiting queue is full."""
        problem = self.queue_full(len(self.waiting), self.waiting_tokens, request)
        if problem is not None:
            raise QueueFullError(problem)
        self._enqueue(request)

    def queue_full(self, waiting: int, waiting_tokens: int, request: Request) -> str | None:
        """Why a queue holding `waiting` requests of `waiting_tokens` tokens takes no more (None
        when it takes this one): a 429 says the replica is full, whatever the count that arrived."""
        if waiting >= self.max_waiting:
            return f"the replica is full: its waiting queue holds {self.max_waiting} requests"
        budget = self.waiting_token_budget
        if waiting and budget is not None and waiting_tokens + request.cost > budget:
            return f"the replica is full: its waiting requests need {waiting_tokens} tokens, more than it serves in its queue time"
        return None

    def _enqueue(self, request: Request, front: bool = False) -> None:
        self.waiting.appendleft(request) if front else self.waiting.append(request)
        self.waiting_tokens += request.cost

    def _dequeue(self, request: Request) -> None:
        """Takes a waiting request out of the queue (admitted or ended)."""
        if self.waiting and self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)
        self.waiting_tokens -= request.cost

    def abort(self, request_id: str) -> None:
        """Takes effect at the next schedule(); unknown or finished ids are ignored."""
        self._abort_requested.add(request_id)

    def schedule(self) -> SchedulerOutput:
        """The next step's plan: its requests, the tokens each computes and their block tables, and
        the block copies of the forks since the last step (an encoder-decoder's: all its running
        requests are in every step, so the copies of each are made by the next)."""
        out = self._begin_step()
        out.blocks_to_copy = [copy for copies in self._copies.values() for copy in copies]
        self._copies.clear()
        if self.decoder_only:
            self._schedule_tokens(out)
        else:
            self._schedule_rows(out)
        return out

    def _schedule_tokens(self, out: SchedulerOutput) -> None:
        """Decoder-only: running decodes, running prompts' chunks, then admissions (the class's docstring)."""
        assert self.blocks is not None
        budget = self.max_num_batched_tokens
        # Running requests: decodes first (one token each), then prompts in progress.
        order = list(self.running.values())
        decodes = sum(r.num_tokens - r.num_computed_tokens == 1 for r in order)
        speculating = decodes <= self.speculation_max_batch
        for prompts in (False, True):
            for r in order:
                remaining = r.num_tokens - r.num_computed_tokens
                if (remaining > 1) != prompts or r.request_id in out.num_tokens or r.finished or r.request_id not in self.running:
                    continue
                drafts = r.draft_ids if speculating and not prompts else []
                n = min(remaining + len(drafts), budget)
                if n == 0 or not self._make_room(r, n, out):
                    continue
                out.num_tokens[r.request_id] = n
                if n > remaining:
                    out.drafts[r.request_id] = drafts[: n - remaining]
                (out.prefill if prompts else out.decode).append(r)
                budget -= n
            budget = self.max_num_batched_tokens - sum(out.num_tokens.values())  # preemptions may have given some back
        if self.policy == "static" and self.running:
            for r in out.decode + out.prefill:
                self._register(r, out)
            return
        while self.waiting and budget > 0 and self.slots.num_free > 0:
            r = self.waiting[0]
            tokens = r.token_ids
            cached = self.blocks.cached_prefix(r.request_id, tokens) if r.params.prompt_logprobs is None else 0
            n = min(len(tokens) - cached, budget)
            if not self.blocks.allocate(r.request_id, cached + n) or not self._admit(r):
                self.blocks.release(r.request_id)
                break
            self.blocks.stats.queries += len(tokens)
            self.blocks.stats.hits += cached
            r.num_computed_tokens = cached
            out.num_tokens[r.request_id] = n
            out.prefill.append(r)
            budget -= n
            self._register(r, out)  # now: a request admitted after it in this step (n > 1) shares its blocks
        for r in out.decode + out.prefill:
            if r.request_id not in out.block_tables:
                self._register(r, out)  # running ones once nothing more can be preempted

    def _make_room(self, r: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for r's next n tokens, preempting the latest-admitted running requests (r itself
        last) until they are free; False when r was preempted."""
        assert self.blocks is not None
        while not self.blocks.allocate(r.request_id, r.num_computed_tokens + n):
            victim = next(reversed(self.running.values()))
            self._preempt(victim, out)
            if victim is r:
                return False
        return True

    def _preempt(self, r: Request, out: SchedulerOutput) -> None:
        del self.running[r.request_id]
        self._release(r)
        r.draft_ids = []
        if r.request_id in out.num_tokens:  # scheduled earlier in this step: unscheduled
            del out.num_tokens[r.request_id]
            out.drafts.pop(r.request_id, None)
            out.decode = [d for d in out.decode if d is not r]
            out.prefill = [p for p in out.prefill if p is not r]
        r.status, r.num_computed_tokens, r.prompt_logprobs_so_far = RequestStatus.WAITING, 0, []
        r.preemptions += 1
        self._enqueue(r, front=True)
        out.preempted.append(r)

    def _register(self, r: Request, out: SchedulerOutput) -> None:
        """Caches the blocks r's scheduled tokens fill and records its block table in the plan."""
        assert self.blocks is not None
        computed = min(r.num_computed_tokens + out.num_tokens[r.request_id], r.num_tokens)  # drafts' blocks are not known yet
        if self.blocks.fills_new_blocks(r.request_id, computed):
            self.blocks.cache_blocks(r.request_id, r.token_ids, computed)
        out.block_tables[r.request_id] = list(self.blocks.table(r.request_id))

    def _schedule_rows(self, out: SchedulerOutput) -> None:
        """Encoder-decoder (or slots alone): every running request, then admissions, each row's
        blocks for its next decoder token."""
        out.decode = list(self.running.values())
        budget = self.max_num_batched_tokens - sum(len(r.slots) for r in out.decode)
        admitting = not (self.policy == "static" and self.running)
        while admitting and self.waiting:
            request = self.waiting[0]
            cost = len(request.prompt_ids) + 1  # its source, and its first decoder token
            if cost > budget and (out.prefill or budget <= 0):
                break  # the step's first admission needs only some budget left: a source is never split
            if not self._admit(request):
                break  # first come, first served: no overtaking by smaller requests
            out.prefill.append(request)
            budget -= cost
        if out.prefill:
            for request in self.waiting:
                budget -= len(request.prompt_ids)
                if budget < 0:
                    break
                out.upcoming.append(request)
        for r in out.decode + out.prefill:
            out.num_tokens[r.request_id] = 1
            if self.blocks is not None:
                for row in self._sequences(r):
                    allocated = self.blocks.allocate(row, r.num_computed_tokens + 1)
                    assert allocated, "the pool holds every row's whole context"
                    out.block_tables[row] = list(self.blocks.table(row))

    def fork(self, r: Request, parents: list[int]) -> None:
        """After a step of beam search (encoder-decoder): beam b of r continues beam parents[b]. A row
        that continues another's beam takes its blocks (KVBlockManager.fork); the copies that makes
        go in the next plan, done before that step writes a key (nothing writes them before)."""
        assert self.blocks is not None and r.request_id not in self._copies, "a fork's copies are made by the next step"
        pairs = [(str(r.slots[parent]), str(r.slots[beam])) for beam, parent in enumerate(parents) if parent != beam]
        tokens = r.num_computed_tokens  # each beam's, this step's included
        copies = self.blocks.fork(pairs, tokens)
        if copies:
            self._copies[r.request_id] = [(source, copy, tokens % self.blocks.block_size) for source, copy in copies]

    def advance(self, plan: SchedulerOutput, rejected: dict[str, int]) -> None:
        """After a step: the scheduled tokens of the requests still running are computed, but for
        the `rejected` drafts of each (by request id), whose keys the next step overwrites."""
        for r in plan.prefill + plan.decode:
            if not r.finished:
                r.num_computed_tokens += plan.num_tokens[r.request_id] - rejected.get(r.request_id, 0)

    def _admit(self, request: Request) -> bool:
        """Moves the first waiting request to running with its slots; False when too few are free."""
        slots = self.slots.allocate(request.slots_needed)
        if slots is None:
            return False
        self._dequeue(request)
        request.slots, request.status = slots, RequestStatus.RUNNING
        request.scheduled_time = request.scheduled_time or time.monotonic()  # a preempted request keeps its first
        self.running[request.request_id] = request
        return True

    def _begin_step(self) -> SchedulerOutput:
        """The step's plan with its aborted and timed-out requests (finished now)."""
        out = SchedulerOutput()
        for request_id in self._abort_requested:
            request = self.running.get(request_id) or next((r for r in self.waiting if r.request_id == request_id), None)
            if request is not None:
                self.finish(request, "abort")
                out.aborted.append(request)
        self._abort_requested.clear()
        out.timed_out = self._expire(time.monotonic())
        return out

    def _expire(self, now: float) -> list[Request]:
        """Ends the requests past their deadline (freeing their slots) and returns them."""
        expired = []
        if self.queue_timeout_s is not None or self.request_timeout_s is not None:
            queue_limit = self.queue_timeout_s if self.queue_timeout_s is not None else float("inf")
            total_limit = self.request_timeout_s if self.request_timeout_s is not None else float("inf")
            expired = [r for r in self.waiting if now - r.arrival_time > min(queue_limit, total_limit)]
            expired += [r for r in self.running.values() if now - r.arrival_time > total_limit]
        for request in expired:
            self.finish(request, "timeout")
        return expired

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends the request and frees its slots at once."""
        if request.finished:
            return
        if request.status is RequestStatus.WAITING:
            self._dequeue(request)
        else:
            del self.running[request.request_id]
            self._release(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    def _sequences(self, r: Request) -> list[str]:
        """r's sequence ids in the block manager: its own (decoder-only), else a row's str(slot)."""
        return [r.request_id] if self.decoder_only else [str(slot) for slot in r.slots]

    def _release(self, request: Request) -> None:
        """Frees what a running request holds: slots, blocks, and its forks' copies not yet made."""
        if self.blocks is not None:
            for seq in self._sequences(request):
                self.blocks.release(seq)
        self._copies.pop(request.request_id, None)
        self.slots.free(request.slots)
        request.slots = []

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by running requests (of cache rows, without blocks)."""
        if self.blocks is None:
            return 1.0 - self.slots.num_free / self.slots.n_slots
        return self.blocks.usage
