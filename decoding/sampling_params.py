"""What a request asks of sampling: torch-free, so that the wire protocol carries it as it is from
the HTTP layer to the engine (decoding/sampling.py applies it)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means all tokens
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p x the most likely one's probability are dropped
    seed: int | None = None
    # OpenAI's: logit - frequency_penalty x count - presence_penalty x (count > 0), counts of the
    # generated tokens. transformers' (and vLLM's) repetition_penalty on every token of the prompt
    # and output: a positive logit divided by it, a negative one multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether adjust_logits changes anything."""
        penalized = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        return penalized or bool(self.logit_bias)


GREEDY = SamplingParams(temperature=0.0)
