"""ragged_step: the index tensors of one step's flattened tokens, built from Python lists."""

import torch

from model.kv_cache import ragged_step

BLOCK = 4


def test_slots_rows_and_blocks_of_a_mixed_step() -> None:
    """Two decodes, a short run after a cached prefix, a chunk from position 0, and an idle row (an
    empty table at position 0, as a translator's step runs): each new token's slot is
    table[position // block] * block + position % block over its table padded with the null block."""
    lens, starts = [1, 3, 1, 2, 1], [5, 6, 0, 0, 0]
    tables = [[7, 3], [2, 9, 4], [5], [8], []]
    step = ragged_step(lens, starts, tables, BLOCK, torch.device("cpu"))
    padded = [t + [0] * (3 - len(t)) for t in tables]
    expected = [table[p // BLOCK] * BLOCK + p % BLOCK for table, s, n in zip(padded, starts, lens, strict=True) for p in range(s, s + n)]
    assert step.slot_mapping.tolist() == expected
    assert step.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0, 5 * 4 + 0, 8 * 4 + 0, 8 * 4 + 1, 0]
    decodes = step.decodes
    assert decodes is not None
    # Each one-token sequence's row in the flat batch, and each token of the short run after a cached
    # prefix (speculative decoding's verification) as a decode row over the keys up to it.
    assert decodes.rows.tolist() == [0, 1, 2, 3, 4, 7]
    assert decodes.lengths.tolist() == [6, 7, 8, 9, 1, 1]
    assert decodes.key_blocks.tolist() == [[7, 3, 0], [2, 9, 4], [2, 9, 4], [2, 9, 4], [5, 0, 0], [0, 0, 0]]  # the longest's 3 blocks
    assert [(c.first, c.length, c.start) for c in step.chunks] == [(5, 2, 0)]  # a chunk from position 0 stays a chunk


def test_a_decode_only_step_keeps_every_row_in_order() -> None:
    step = ragged_step([1, 1, 1], [0, 4, 9], [[1], [2, 3], [4, 5, 6]], BLOCK, torch.device("cpu"))
    assert step.decodes is not None and not step.chunks
    assert step.decodes.rows.tolist() == [0, 1, 2]
    assert step.decodes.key_blocks.tolist() == [[1, 0, 0], [2, 3, 0], [4, 5, 6]]
    assert step.slot_mapping.tolist() == [4, 12, 25]
    assert step.decodes.mask[:, 0, 0].sum(-1).tolist() == [1, 5, 10]  # keys each row attends to
