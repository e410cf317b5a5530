"""Speculative decoding without a draft model: prompt lookup (vLLM's n-gram proposer).

A sequence's next tokens are guessed from its own context: where its last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) occurred before, in its prompt or output, the
tokens that followed them there are proposed. The engine's next step computes the sequence's
last token and the proposals together (k + 1 query tokens over its blocks) and keeps the longest
run of proposals that the sampler, row by row, draws itself (GeneratorRunner: `_verify`), plus
the token drawn after them: the outputs are those of decoding one token at a time, seed for seed.

Each request proposes at most its own budget of tokens, which follows its acceptance: all taken,
one more next time (up to num_speculative_tokens); some refused, the number taken plus one.
"""

from dataclasses import dataclass, field


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
    # n-gram -> where its latest occurrence ends (the index of the token after it); over the
    # n-grams that end before the context's last token, so a suffix never matches itself.
    _ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # n-grams ending at positions below this are in _ends

    def __post_init__(self) -> None:
        self.budget = self.max_tokens

    def propose(self, tokens: list[int]) -> list[int]:
        length = len(tokens)
        for end in range(max(self._indexed, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, length)
        if self.budget <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found = self._ends.get(tuple(tokens[length - n :]))
            if found is not None:  # what followed it; near the end, the text from there on repeating itself
                return [tokens[found + i % (length - found)] for i in range(self.budget)]
        return []

    def accepted(self, proposed: int, taken: int) -> None:
        """Adapts the budget after a step that proposed `proposed` tokens and kept `taken` of them."""
        self.budget = min(self.max_tokens, taken + 1)
