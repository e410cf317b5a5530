"""Behaviour of the two models: causality, padding, caching, checkpoints, decoding."""

from pathlib import Path

import pytest
import torch
from torch import Tensor

from decoding.reference_decoding import beam_search_uncached, generate_greedy_uncached, greedy_translate_uncached
from loading.checkpoint import load_checkpoint, save_checkpoint
from loading.tokenizer import Tokenizer
from model.config import GeneratorConfig, TranslatorConfig
from model.generator import Generator
from model.kv_cache import PagedKVCache, ragged_step
from model.masks import padding_mask
from model.translator import Translator

POSITIONS = ["sinusoidal", "rope", "alibi"]


def tiny_translator(positions: str = "sinusoidal", norm_first: bool = False) -> Translator:
    config = TranslatorConfig.preset("tiny")
    config = TranslatorConfig.from_dict({**config.to_dict(), "positions": positions, "norm_first": norm_first})
    return Translator(config).eval()


def tiny_generator(positions: str = "rope", norm_first: bool = True) -> Generator:
    config = GeneratorConfig.preset("tiny")
    config = GeneratorConfig.from_dict({**config.to_dict(), "positions": positions, "norm_first": norm_first})
    return Generator(config).eval()


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("norm_first", [True, False])
def test_generator_is_causal(positions: str, norm_first: bool) -> None:
    model = tiny_generator(positions, norm_first)
    ids = torch.randint(4, 64, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(4, 64, (2, 5))
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("positions", POSITIONS)
def test_translator_decoder_is_causal_and_padding_is_invisible(positions: str) -> None:
    model = tiny_translator(positions)
    src = torch.randint(4, 64, (1, 6))
    padded_src = torch.cat([src, torch.zeros(1, 4, dtype=torch.long)], dim=1)  # pad_id 0
    tgt = torch.randint(4, 64, (1, 8))
    changed_tgt = tgt.clone()
    changed_tgt[:, 5:] = 9
    with torch.no_grad():
        logits = model(src, tgt)
        torch.testing.assert_close(model(padded_src, tgt), logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(src, changed_tgt)[:, :5], logits[:, :5])
        # Real source positions of the encoder output do not move either.
        torch.testing.assert_close(model.encode(padded_src)[:, :6], model.encode(src), rtol=1e-5, atol=1e-5)


def test_right_padding_does_not_change_generator_outputs() -> None:
    model = tiny_generator()
    ids = torch.randint(4, 64, (1, 9))
    batch = torch.cat([torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1), torch.randint(4, 64, (1, 12))])
    with torch.no_grad():
        torch.testing.assert_close(model(batch)[:1, :9], model(ids), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def paged_logits(
    model: Generator, ids: Tensor, prompt_lengths: list[int], steps: int, block_size: int = 4
) -> tuple[list[Tensor], list[Tensor]]:
    """The engine's cached path over a paged KV cache (model/kv_cache.py): the rows' prompts
    ids[row, :n] computed as one ragged step, each row's blocks scattered over the pool, then
    `steps` steps of one token per row. Returns each row's prompt logits (n, V), and each step's (B, V)."""
    c, B = model.config, ids.shape[0]
    per_row = -(-ids.shape[1] // block_size)
    order = torch.randperm(B * per_row, generator=torch.Generator().manual_seed(0)) + 1  # block 0 is the null block
    tables = order.view(B, per_row).tolist()
    cache = PagedKVCache(c.n_layers, B * per_row + 1, block_size, c.kv_heads, c.head_dim)

    def step(counts: list[int], starts: list[int]) -> Tensor:
        layers = cache.layers(ragged_step(counts, starts, tables, block_size, ids.device, model.positions.alibi_slopes))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        rows = torch.cat([torch.full((n,), b) for b, n in enumerate(counts)])
        return model.forward_ragged(ids[rows, positions], positions, layers, torch.arange(len(positions)))

    prompts = list(step(prompt_lengths, [0] * B).split(prompt_lengths))
    return prompts, [step([1] * B, [n + t for n in prompt_lengths]) for t in range(steps)]


@pytest.mark.parametrize("positions", POSITIONS)
def test_generator_kv_cache_logits_equal_full_recomputation(positions: str) -> None:
    """The paged cache's logits (prompts of different lengths computed together, then decodes) equal
    the full sequences' computed whole."""
    model = tiny_generator(positions)
    ids = torch.randint(4, 64, (3, 20))
    prompt_lengths = [5, 9, 3]
    with torch.no_grad():
        full = model(ids)  # (3, 20, V)
    prompts, steps = paged_logits(model, ids, prompt_lengths, 8)
    for row, n in enumerate(prompt_lengths):
        torch.testing.assert_close(prompts[row], full[row, :n], rtol=1e-4, atol=1e-5)
    for t, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[torch.arange(3), torch.tensor(prompt_lengths) + t], rtol=1e-4, atol=1e-5)


def test_beam_size_one_equals_greedy_and_wider_beams_score_at_least_as_well() -> None:
    model = tiny_translator()
    src = torch.randint(4, 64, (5, 6))
    greedy = greedy_translate_uncached(model, src, 15)
    beams = beam_search_uncached(model, src, beam_size=1, max_new_tokens=15)
    assert [h[0].tokens for h in beams] == greedy
    wide = beam_search_uncached(model, src, beam_size=4, max_new_tokens=15, n_best=3)
    assert all(len(h) == 3 and h[0].score >= h[1].score >= h[2].score for h in wide)


def test_save_then_load_gives_identical_logits(tmp_path: Path) -> None:
    tokenizer = Tokenizer.train([f"sentence number {i} with words" for i in range(200)] * 3, vocab_size=300)
    for model in (tiny_translator(), tiny_generator()):
        save_checkpoint(tmp_path / type(model).__name__, model, tokenizer, {"steps": 0})
        loaded, loaded_tokenizer = load_checkpoint(tmp_path / type(model).__name__)
        ids = torch.randint(4, 64, (2, 6))
        with torch.no_grad():
            before = model(ids, ids) if isinstance(model, Translator) else model(ids)
            after = loaded(ids, ids) if isinstance(loaded, Translator) else loaded(ids)
        torch.testing.assert_close(before, after, rtol=0, atol=0)
        assert loaded.config == model.config
        assert loaded_tokenizer.encode("sentence 5") == tokenizer.encode("sentence 5")


def test_padding_mask_shape() -> None:
    mask = padding_mask(torch.tensor([[5, 6, 0]]), pad_id=0)
    assert mask.shape == (1, 1, 1, 3) and mask.tolist() == [[[[True, True, False]]]]


def test_uncached_greedy_generation_extends_prompt() -> None:
    out = generate_greedy_uncached(tiny_generator(), [5, 6, 7], 4)
    assert len(out) == 4 and all(0 <= t < 64 for t in out)


def test_rows_grouped_on_one_source_give_the_logits_of_each_row_with_its_own_copy() -> None:
    """Translator.decode with memory_group k (a sentence's k beams read its cross-attention keys
    once) equals decoding every row against its own copy of its sentence's keys."""
    model = tiny_translator("sinusoidal")
    k = 3
    src = torch.randint(4, 64, (2, 7))
    src[1, 5:] = 0  # the second sentence is shorter: padding hidden by the source mask
    memory_kv = model.cross_key_values(model.encode(src))
    src_mask = padding_mask(src, 0)  # (2, 1, 1, S)
    tgt = torch.randint(4, 64, (2 * k, 5))  # rows 0-2 decode sentence 0, rows 3-5 sentence 1
    per_row_kv = [(keys.repeat_interleave(k, 0), values.repeat_interleave(k, 0)) for keys, values in memory_kv]
    with torch.no_grad():
        separate = model.decode(tgt, per_row_kv, src_mask.repeat_interleave(k, 0))
        grouped = model.decode(tgt, memory_kv, src_mask, memory_group=k)
    torch.testing.assert_close(grouped, separate, rtol=1e-5, atol=1e-5)


def test_a_state_dict_with_separate_query_key_value_projections_loads_into_qkv_proj() -> None:
    """Checkpoints written before qkv_proj hold self-attention's q_proj, k_proj and v_proj apart."""
    model = tiny_translator()
    old_layout: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn.qkv_proj." in name:
            for projection, part in zip("qkv", tensor.chunk(3), strict=True):
                old_layout[name.replace("qkv_proj", f"{projection}_proj")] = part.clone()
        else:
            old_layout[name] = tensor
    assert not any("qkv_proj" in name for name in old_layout)
    loaded = Translator(model.config).eval()
    loaded.load_state_dict(old_layout)  # strict: no key missing or left over
    src, tgt = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]])
    assert torch.equal(loaded(src, tgt), model(src, tgt))


@pytest.mark.parametrize("positions", ["sinusoidal", "rope"])
def test_ragged_encode_equals_the_padded_encode_at_real_tokens(positions: str) -> None:
    """Sources side by side (no padding computed) give each source the encoder output it has when
    the batch is padded to the longest."""
    model = tiny_translator(positions)
    sources = [torch.randint(4, 64, (n,)) for n in (6, 1, 11, 3)]
    padded = torch.zeros(len(sources), 11, dtype=torch.long)  # pad_id 0
    for row, source in zip(padded, sources, strict=True):
        row[: len(source)] = source
    with torch.inference_mode():
        ragged = model.encode_ragged(torch.cat(sources), [len(s) for s in sources])[0]  # (N, d)
        expected = torch.cat([out[: len(s)] for out, s in zip(model.encode(padded), sources, strict=True)])
    torch.testing.assert_close(ragged, expected, rtol=0, atol=1e-5)
