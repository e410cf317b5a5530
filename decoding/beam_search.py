"""Beam search's bookkeeping for the translator, batched across sentences.

`BeamState` is one sentence's live beams and finished hypotheses, `step_beams` one step of many
sentences' searches: the serving engine drives them over its slots (service/engine/runner.py),
the plain reference (decoding/reference_decoding.py) over recomputed prefixes.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from decoding.top_k_cpu import row_top_k


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, without the decoder's start token and eos
    score: float  # sum of log-probabilities / length ** length_penalty


class BeamState:
    """Live beams of one sentence. A hypothesis ends with eos_id (the model's); the search finishes
    when beam_size hypotheses have ended (early stopping) or max_new_tokens is reached."""

    def __init__(self, beam_size: int, max_new_tokens: int, eos_id: int, length_penalty: float = 1.0) -> None:
        self.beam_size = beam_size
        self.eos_id = eos_id
        self.max_new_tokens = max_new_tokens
        self.length_penalty = length_penalty
        self.scores = [0.0] + [float("-inf")] * (beam_size - 1)  # all beams start identical: expand only the first
        self.sequences: list[list[int]] = [[] for _ in range(beam_size)]
        self.finished: list[Hypothesis] = []
        self.done = False

    def _normalised(self, score: float, length: int) -> float:
        return score / (length**self.length_penalty)

    def advance(self, parents: list[int], tokens: list[int], scores: list[float], endings: list[tuple[int, float]]) -> None:
        """Takes the step chosen from this sentence's 2K best candidates (best first): the beams
        ending with eos among the K best, as (parent, score), become hypotheses; the K best others
        are the live beams, beam i continuing beam parents[i] with tokens[i], scored scores[i]."""
        for parent, score in endings:
            sequence = self.sequences[parent]
            self.finished.append(Hypothesis(sequence, self._normalised(score, len(sequence) + 1)))
        self.sequences = [self.sequences[p] + [t] for p, t in zip(parents, tokens, strict=True)]
        self.scores = scores
        if len(self.finished) >= self.beam_size or len(self.sequences[0]) >= self.max_new_tokens:
            self.done = True

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses; unfinished beams count when fewer than n have ended."""
        pool = list(self.finished)
        if len(pool) < n:
            pool += [Hypothesis(s, self._normalised(sc, len(s) + 1)) for s, sc in zip(self.sequences, self.scores, strict=True)]
        return sorted(pool, key=lambda h: h.score, reverse=True)[:n]


def step_beams(states: list[BeamState], logits: Tensor, rows: Tensor | None = None) -> list[tuple[list[int], list[int]]]:
    """One step of several sentences' searches: logits (N, V), suppressed ids at -inf, whose rows
    `rows` (sum of the beam sizes,) are each sentence's live beams in order (None: all N rows, in
    order), read where they lie. A beam's candidates are its 2K most likely tokens (no other of its
    tokens can be among its sentence's 2K best), scored by its score plus their log-probabilities
    (logit less the row's log-sum-exp); one top-k over the K x 2K candidates of each sentence serves
    all the sentences of a beam size, and the choice among a sentence's 2K best is made for all of
    them at once: an eos among the K best ends a hypothesis, the K best others live on (there are K
    at least: a beam's candidates hold one eos at most). Returns each sentence's (parents, tokens),
    K each: live beam i continues beam parents[i] with tokens[i]."""
    V = logits.shape[-1]
    widest = min(2 * max(state.beam_size for state in states), V)
    top_logits, top_ids, lse = row_top_k(logits.float().cpu(), widest, rows=rows)  # (R, widest) twice, (R,)
    assert lse is not None
    top_log_probs = top_logits - lse[:, None]  # (R, widest)
    starts = [0]
    for state in states:
        starts.append(starts[-1] + state.beam_size)
    moves: list[tuple[list[int], list[int]]] = [([], [])] * len(states)
    for K in sorted({state.beam_size for state in states}):
        group = [i for i, state in enumerate(states) if state.beam_size == K]
        G, width = len(group), min(2 * K, V)
        log_probs, ids = top_log_probs[:, :width], top_ids[:, :width]  # (G * K, width): every sentence has this beam size, the usual case
        if len(states) > G:
            rows = torch.tensor([starts[i] + k for i in group for k in range(K)])
            log_probs, ids = log_probs.index_select(0, rows), ids.index_select(0, rows)
        scores = torch.tensor([states[i].scores for i in group])  # (G, K)
        candidates = (scores[:, :, None] + log_probs.reshape(G, K, width)).view(G, K * width)
        top_scores, top_index = candidates.topk(min(2 * K, K * width), dim=-1)  # (G, C) each, C = 2K but where V < 2K
        tokens = ids.reshape(G, K * width).gather(1, top_index)  # (G, C)
        parents = top_index // width  # (G, C)
        is_eos = tokens == torch.tensor([states[i].eos_id for i in group])[:, None]  # (G, C)
        live = ~is_eos & (torch.cumsum(~is_eos, dim=1) <= K)  # (G, C): the K best candidates that are not eos
        ending = is_eos[:, :K]  # (G, K): an ending counts only among the K best candidates
        endings: list[list[tuple[int, float]]] = [[] for _ in group]  # each sentence's (parent, score), best first
        ended = zip(ending.nonzero()[:, 0].tolist(), parents[:, :K][ending].tolist(), top_scores[:, :K][ending].tolist(), strict=True)
        for n, parent, score in ended:
            endings[n].append((parent, score))
        chosen = (t[live].view(G, K).tolist() for t in (parents, tokens, top_scores))
        for i, step_parents, step_tokens, step_scores, step_endings in zip(group, *chosen, endings, strict=True):
            states[i].advance(step_parents, step_tokens, step_scores, step_endings)
            moves[i] = (step_parents, step_tokens)
    return moves
