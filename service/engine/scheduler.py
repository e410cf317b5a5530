"""Which requests run this step. Holds no tensors: a waiting queue, a running set and a slot allocator."""

import time
from collections import deque
from dataclasses import dataclass, field

from service.engine.config import BatchingPolicy, FinishReason
from service.engine.errors import QueueFullError
from service.engine.request import Request, RequestStatus


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

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def batch_size(self) -> int:
        return len(self.prefill) + len(self.decode)


class Scheduler:
    """Admission by free slots and a per-step prompt-token budget; a bounded waiting queue.

    policy "continuous" admits between any two decode steps; "static" (request-level batching,
    for comparison) admits only when the running batch has drained.
    """

    def __init__(
        self,
        n_slots: int,
        max_waiting: int,
        max_prefill_tokens: int,
        policy: BatchingPolicy = "continuous",
        queue_timeout_s: float | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        """queue_timeout_s: the longest a request may wait for admission; request_timeout_s: the
        longest from arrival to its last token. Past either, it ends with reason "timeout"."""
        self.slots = SlotAllocator(n_slots)
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.policy = policy
        self.queue_timeout_s, self.request_timeout_s = queue_timeout_s, request_timeout_s
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self._abort_requested: set[str] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._abort_requested)

    def add(self, request: Request) -> None:
        """Queues the request; raises QueueFullError when the waiting queue is full."""
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"waiting queue full ({self.max_waiting} requests)")
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Takes effect at the next schedule(); unknown or finished ids are ignored."""
        self._abort_requested.add(request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for request_id in self._abort_requested:
            request = self.running.get(request_id) or next((r for r in self.waiting if r.request_id == request_id), None)
            if request is not None:
                self.finish(request, "abort")
                out.aborted.append(request)
        self._abort_requested.clear()
        out.timed_out = self._expire(time.monotonic())
        out.decode = list(self.running.values())
        if self.policy == "static" and self.running:
            return out
        budget = self.max_prefill_tokens
        while self.waiting:
            request = self.waiting[0]
            if out.prefill and len(request.prompt_ids) > budget:
                break  # the budget bounds one step's prompt work; the first admission is always allowed
            slots = self.slots.allocate(request.slots_needed)
            if slots is None:
                break  # first come, first served: no overtaking by smaller requests
            self.waiting.popleft()
            request.slots, request.status, request.scheduled_time = slots, RequestStatus.RUNNING, time.monotonic()
            self.running[request.request_id] = request
            out.prefill.append(request)
            budget -= len(request.prompt_ids)
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
            self.waiting.remove(request)
        else:
            del self.running[request.request_id]
            self.slots.free(request.slots)
            request.slots = []
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    @property
    def kv_usage(self) -> float:
        """Fraction of cache rows in use."""
        return 1.0 - self.slots.num_free / self.slots.n_slots
