"""Speculative decoding without a draft model: prompt lookup (vLLM's n-gram proposer).

A sequence's next tokens are guessed from its own context: where its last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) occurred before, in its prompt or output, the
tokens that followed them there are proposed. The engine's next step computes the sequence's
last token and the proposals together (k + 1 query tokens over its blocks) and keeps the longest
run of proposals that the sampler, row by row, draws itself (GeneratorRunner: `_verify`), plus
the token drawn after them: the outputs are those of decoding one token at a time, seed for seed.

Where a sequence's own context has no match, the outputs of the engine's recent requests may
have one (`RecentOutputs`, suffix decoding's idea): answers to similar requests repeat each other
(templates, boilerplate, the same facts). Outputs stay as they are; only how fast a request is
answered can depend on what others were answered, as with prefix caching.

Each request proposes at most its own budget of tokens, which follows its acceptance: all taken,
one more next time (up to num_speculative_tokens); some refused, the number taken plus one.
"""

from collections import OrderedDict
from dataclasses import dataclass, field


class RecentOutputs:
    """The n-grams (min_n <= n <= max_n) of the engine's recent outputs, each with the few prompt
    tokens before it, and what followed them: at most max_tokens tokens of outputs, the oldest
    dropped first (about 100 bytes of index per token and n). Contract: `propose(context, k)` returns
    up to k tokens that followed the context's longest suffix of n tokens in the latest output that
    has it, or []."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self._held = 0  # tokens in _outputs
        self._next_id = 0
        self._ends: dict[int, int] = {}  # an n-gram's hash -> output id << 32 | where it ends there

    def add(self, tokens: list[int]) -> None:
        """Indexes an output (its prompt's last max_n tokens first) as the latest."""
        if len(tokens) > self.max_tokens:
            return
        key, self._next_id = self._next_id, self._next_id + 1
        self._outputs[key] = tokens
        self._held += len(tokens)
        for end in range(self.min_n, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[hash(tuple(tokens[end - n : end]))] = key << 32 | end
        while self._held > self.max_tokens:
            _, dropped = self._outputs.popitem(last=False)
            self._held -= len(dropped)
        if len(self._ends) > 2 * self.max_tokens * (self.max_n - self.min_n + 1):  # half of them dropped outputs'
            self._ends = {gram: at for gram, at in self._ends.items() if at >> 32 in self._outputs}

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            found = self._ends.get(hash(tuple(context[len(context) - n :])))
            if found is not None and found >> 32 in self._outputs:  # (a hash that collides proposes badly: verified anyway)
                return self._outputs[found >> 32][found & 0xFFFFFFFF : (found & 0xFFFFFFFF) + k]
        return []


@dataclass
class PromptLookup:
    """One sequence's n-gram index and proposal budget. Contract: `propose(tokens)` is called with
    the sequence's whole context (prompt then output), which only grows between calls; it returns
    `budget` tokens that followed the latest earlier occurrence of the context's longest matching
    suffix of n tokens (min_n <= n <= max_n), taking the text from there to the end as repeating
    when fewer follow it, or [] when none occurred."""

    min_n: int
    max_n: int
    max_tokens: int
    budget: int = 0
    # An n-gram's hash -> where its latest occurrence ends (the index of the token after it); over
    # the n-grams that end before the context's last token, so a suffix never matches itself.
    _ends: dict[int, int] = field(default_factory=dict)
    _indexed: int = 0  # n-grams ending at positions below this are in _ends

    def __post_init__(self) -> None:
        self.budget = self.max_tokens

    def propose(self, tokens: list[int], recent: RecentOutputs | None = None) -> list[int]:
        """(The class's contract); where the context has no match, recent's proposal for it."""
        length = len(tokens)
        for end in range(max(self._indexed, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[hash(tuple(tokens[end - n : end]))] = end
        self._indexed = max(self._indexed, length)
        if self.budget <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found = self._ends.get(hash(tuple(tokens[length - n :])))
            if found is not None:  # what followed it; near the end, the text from there on repeating itself
                return [tokens[found + i % (length - found)] for i in range(self.budget)]
        return recent.propose(tokens[-self.max_n :], self.budget) if recent is not None else []

    def accepted(self, proposed: int, taken: int) -> None:
        """Adapts the budget after a step that proposed `proposed` tokens and kept `taken` of them."""
        self.budget = min(self.max_tokens, taken + 1)
