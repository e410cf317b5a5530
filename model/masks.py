"""Boolean attention masks: True where a query may attend to a key."""

import torch
from torch import Tensor


def padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """Keys that are real tokens. ids: (B, S) -> (B, 1, 1, S), broadcast over heads and queries."""
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device | None = None) -> Tensor:
    """Position t sees positions <= t. Returns (1, 1, T, T)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
