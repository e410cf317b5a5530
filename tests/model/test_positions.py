import math

import torch

from model.positions import alibi_bias, alibi_slopes, apply_rope, rope_tables, sinusoidal_table


def test_sinusoidal_table_matches_the_formula() -> None:
    d_model = 16
    table = sinusoidal_table(50, d_model)
    for pos in (0, 1, 7, 49):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)


def test_rope_scores_depend_only_on_relative_offset() -> None:
    head_dim = 16
    cos, sin = rope_tables(64, head_dim)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(m: int, n: int) -> float:
        rq = apply_rope(q.view(1, 1, 1, -1), cos[m].view(1, 1, 1, -1), sin[m].view(1, 1, 1, -1))
        rk = apply_rope(k.view(1, 1, 1, -1), cos[n].view(1, 1, 1, -1), sin[n].view(1, 1, 1, -1))
        return float((rq * rk).sum())

    for offset in (0, 3, 10):
        base = score(offset, 0)
        for shift in (1, 5, 40):
            assert math.isclose(score(offset + shift, shift), base, rel_tol=1e-4, abs_tol=1e-4)
    assert not math.isclose(score(3, 0), score(10, 0), rel_tol=1e-3)


def test_rope_preserves_norm() -> None:
    cos, sin = rope_tables(32, 8)
    x = torch.randn(2, 3, 32, 8)
    rotated = apply_rope(x, cos[None, None], sin[None, None])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_alibi_slopes_and_bias() -> None:
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2 ** -(i + 1) for i in range(8)]))
    assert len(alibi_slopes(6)) == 6
    positions = torch.arange(5)[None]
    bias = alibi_bias(alibi_slopes(4), positions, positions)  # (1, 4, 5, 5)
    assert bias.shape == (1, 4, 5, 5)
    assert float(bias[0, 0, 4, 1]) == -0.25 * 3
    assert float(bias[0, :, 2, 2].abs().max()) == 0.0
