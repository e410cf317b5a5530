"""The Responses API's store (`store: true`): the responses a client may read back
(`GET /v1/responses/{id}`), delete, or continue (`previous_response_id`), each readable only with
the API key that made it. In the ingress process's memory: bounded in count (the oldest is dropped
first) and in age, and lost with the process (as vLLM's store)."""

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.protocol import ChatMessage


def owner_of(key: str | None) -> str:
    """Who a response belongs to: the SHA-256 of the API key that asked for it ("" without keys)."""
    return "" if key is None else hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    stored_at: float  # the store's clock
    response: dict[str, Any]  # as answered
    conversation: tuple[ChatMessage, ...]  # every message up to and including its output, instructions left out


class ResponseStore:
    """At most max_entries responses, none older than ttl_s; get() and delete() see a response
    only for its owner (to anyone else it does not exist)."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, owner: str, response: dict[str, Any], conversation: tuple[ChatMessage, ...]) -> None:
        self._expire()
        self._entries[response["id"]] = StoredResponse(owner, self.clock(), response, conversation)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        """Whether the owner's response was there (and is gone now)."""
        if self.get(owner, response_id) is None:
            return False
        del self._entries[response_id]
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        oldest_kept = self.clock() - self.ttl_s
        while self._entries and next(iter(self._entries.values())).stored_at < oldest_kept:
            self._entries.popitem(last=False)
