"""Translation's batching helpers, shared by the engine (service/engine/runner.py) and the
reference decoders: the default output length cap, and right-padding of sources."""

import torch
from torch import Tensor


def max_new_tokens_for(source_length: int, max_len: int) -> int:
    """Default target length cap for a source of source_length tokens (eos included); German runs
    longer than English. The service uses the same default."""
    return min(2 * source_length + 10, max_len - 1)


def pad_batch(sequences: list[list[int]], pad_id: int) -> Tensor:
    """Right-pads with pad_id (the model's) into (B, longest)."""
    out = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out
