"""Hugging Face folders load exactly into our modules: a MarianMT (opus-mt's shape) and a GPT-NeoX
(Pythia's) built in tests/hf_folders.py give transformers' logits, greedy outputs and tokenizer ids;
exported again through the same tables they give the folder's tensors back; our shipped checkpoints
exported with exports.export come back with their own logits; folders that cannot be served raise a
one-line CheckpointError naming the file."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerBase

from exports.export import export_hf
from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR, load_checkpoint, load_native_checkpoint
from loading.folder import inspect_folder
from loading.hf import load
from loading.hf.registry import ADAPTERS
from loading.hf_tokenizers import FastTextTokenizer, MarianTextTokenizer
from loading.tokenizer import TextTokenizer, Tokenizer
from model.generator import Generator
from model.packed_linear import PackedLinear, pack_linear_layers, packing_available
from model.quantize import Int8Linear, quantize_weights
from model.translator import Translator
from tests.hf_folders import build_gpt_neox_folder, build_marian_folder, one_line_error, shakespeare_lines
from training.data import SHARED_DATA, read_lines

ATOL = 1e-4
NEW_TOKENS = 20
ENGLISH = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.en.gz")[:1000]
FRENCH = read_lines(SHARED_DATA / "multi30k" / "test_2016_flickr.fr.gz")[:1000]
NON_ASCII = ["Café déjà vu, naïve façade.\n", "Emoji 🙂👍🏽 and ✓ marks", "漢字かな交じり文\n", "Ünïcödé — “quoted” ½ €5"]


@pytest.fixture(scope="module")
def marian_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_marian_folder(tmp_path_factory.mktemp("hf") / "marian")


@pytest.fixture(scope="module")
def gpt_neox_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_neox_folder(tmp_path_factory.mktemp("hf") / "gpt-neox")


def loaded_translator(folder: Path) -> tuple[Translator, TextTokenizer]:
    model, tokenizer = load_checkpoint(folder)
    assert isinstance(model, Translator)
    return model, tokenizer


def loaded_generator(folder: Path) -> tuple[Generator, TextTokenizer]:
    model, tokenizer = load_checkpoint(folder)
    assert isinstance(model, Generator)
    return model, tokenizer


def assert_export_after_load_gives_the_folders_tensors(folder: Path, dtype: torch.dtype = torch.float32) -> None:
    """Loading folder in dtype (its weights') then exporting through its adapter's table gives every
    tensor of the folder back: the same names, shapes, dtypes and values."""
    model, _ = load_checkpoint(folder, "cpu", dtype)
    exported = ADAPTERS[inspect_folder(folder).architecture].table.export(model.config, model.state_dict())
    held = {name: tensor for file in folder.glob("*.safetensors") for name, tensor in load_file(str(file)).items()}
    assert exported.keys() == held.keys()
    for name, tensor in held.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def in_bfloat16(folder: Path, out: Path) -> Path:
    """A copy of folder with its weights stored in bfloat16."""
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def right_padded(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows])


def marian_inputs(model: Translator, tokenizer: TextTokenizer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n test sentences (with </s>), right-padded, and decoder inputs from decoder_start."""
    c = model.config
    src = right_padded([tokenizer.encode(s) + [c.eos_id] for s in ENGLISH[:n]], c.pad_id)
    tgt = torch.cat([torch.full((n, 1), c.start_id), torch.randint(0, c.vocab_size - 1, (n, 7))], dim=1)
    return src, tgt


def test_marian_logits_equal_transformers(marian_folder: Path) -> None:
    model, tokenizer = loaded_translator(marian_folder)
    c = model.config
    assert (c.activation, c.scale_embedding, c.logits_bias, c.sinusoid_layout) == ("silu", True, True, "halves")
    assert c.start_id == c.pad_id == c.vocab_size - 1 and c.suppressed_ids == (c.pad_id,) and c.target_lang == "fr"
    hf = AutoModelForSeq2SeqLM.from_pretrained(marian_folder).eval()
    src, tgt = marian_inputs(model, tokenizer, 8)
    with torch.no_grad():
        expected = hf(input_ids=src, attention_mask=src != c.pad_id, decoder_input_ids=tgt).logits
        assert (model(src, tgt) - expected).abs().max() <= ATOL


def test_gpt_neox_logits_equal_transformers(gpt_neox_folder: Path) -> None:
    model, tokenizer = loaded_generator(gpt_neox_folder)
    c = model.config
    assert (c.parallel_residual, c.rotary_fraction, c.tie_embeddings, c.vocab_size) == (True, 0.25, False, 832)
    hf = AutoModelForCausalLM.from_pretrained(gpt_neox_folder).eval()
    ids = torch.tensor([tokenizer.encode("".join(shakespeare_lines()[-40 * (i + 1) :]))[:50] for i in range(4)])
    with torch.no_grad():
        assert (model(ids) - hf(input_ids=ids).logits).abs().max() <= ATOL


def test_marian_export_after_load_gives_the_folders_tensors_back(marian_folder: Path, tmp_path: Path) -> None:
    """q/k/v stacked into qkv_proj and split again, final_logits_bias (1, V) as (V,) and back; in float32
    and bfloat16. A folder holding the shared embedding as the encoder's loads alike."""
    assert_export_after_load_gives_the_folders_tensors(marian_folder)
    assert_export_after_load_gives_the_folders_tensors(in_bfloat16(marian_folder, tmp_path / "bf16"), torch.bfloat16)
    aliased = Path(shutil.copytree(marian_folder, tmp_path / "aliased"))
    tensors = load_file(str(aliased / "model.safetensors"))
    tensors["model.encoder.embed_tokens.weight"] = tensors.pop("model.shared.weight")
    save_file(tensors, str(aliased / "model.safetensors"))
    reference = loaded_translator(marian_folder)[0].state_dict()
    assert all(torch.equal(t, reference[name]) for name, t in loaded_translator(aliased)[0].state_dict().items())


def test_gpt_neox_export_after_load_gives_the_folders_tensors_back(gpt_neox_folder: Path, tmp_path: Path) -> None:
    """query_key_value's per-head rows regrouped into qkv_proj and back; in float32 and bfloat16."""
    assert_export_after_load_gives_the_folders_tensors(gpt_neox_folder)
    assert_export_after_load_gives_the_folders_tensors(in_bfloat16(gpt_neox_folder, tmp_path / "bf16"), torch.bfloat16)


def test_tensors_read_a_few_rows_at_a_time_load_alike(gpt_neox_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = loaded_generator(gpt_neox_folder)[0].state_dict()
    monkeypatch.setattr(load, "CHUNK_BYTES", 1000)  # 3 rows of the (832, 64) float32 embeddings at a time
    assert_export_after_load_gives_the_folders_tensors(gpt_neox_folder)
    assert all(torch.equal(t, whole[name]) for name, t in loaded_generator(gpt_neox_folder)[0].state_dict().items())


def greedy(model: Translator | Generator, prompt: list[int], src: list[int] | None = None) -> list[int]:
    """Our modules' greedy continuation (no cache), never choosing a suppressed id, up to eos."""
    c = model.config
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            if isinstance(model, Translator):
                logits = model(torch.tensor([src]), torch.tensor([prompt + out]))[0, -1]
            else:
                logits = model(torch.tensor([prompt + out]))[0, -1]
        logits[list(c.suppressed_ids)] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] == c.eos_id:
            break
    return out


def test_marian_greedy_equals_generate(marian_folder: Path) -> None:
    model, tokenizer = loaded_translator(marian_folder)
    c = model.config
    hf = AutoModelForSeq2SeqLM.from_pretrained(marian_folder).eval()
    for sentence in ENGLISH[:4]:
        src = tokenizer.encode(sentence) + [c.eos_id]
        expected = hf.generate(torch.tensor([src]), do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS, bad_words_ids=[[c.pad_id]])
        assert [c.start_id, *greedy(model, [c.start_id], src)] == expected[0].tolist()


def test_gpt_neox_greedy_equals_generate(gpt_neox_folder: Path) -> None:
    model, tokenizer = loaded_generator(gpt_neox_folder)
    hf = AutoModelForCausalLM.from_pretrained(gpt_neox_folder).eval()
    for prompt in ["ROMEO:\n", "First Citizen:\nWe are", "KING HENRY:\nNow"]:
        ids = tokenizer.encode(prompt)
        expected = hf.generate(torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS, pad_token_id=1)
        assert ids + greedy(model, ids) == expected[0].tolist()


def streamed(tokenizer: TextTokenizer, ids: list[int]) -> str:
    return b"".join(tokenizer.piece_bytes(i) for i in ids).decode("utf-8")


def test_marian_tokenizer_gives_marian_tokenizers_ids_and_text(marian_folder: Path) -> None:
    _, tokenizer = loaded_translator(marian_folder)
    assert isinstance(tokenizer, MarianTextTokenizer)
    hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(marian_folder)
    for text in [*ENGLISH, ">>fr<< A man sleeps.", "Zebras ☃ xylophone"]:
        assert tokenizer.encode(text) + [tokenizer.eos_id] == hf(text).input_ids, text
    assert tokenizer.encode_batch(ENGLISH[:3]) == [tokenizer.encode(s) for s in ENGLISH[:3]]
    for sentence in FRENCH:  # outputs: ids of French pieces, with specials around
        ids = [tokenizer.pad_id, *(tokenizer.ids.get(p, tokenizer.unk_id) for p in tokenizer.target.encode(sentence, out_type=str))]
        ids.append(tokenizer.eos_id)
        text = tokenizer.decode(ids)
        assert text == hf.decode(ids, skip_special_tokens=True)
        assert streamed(tokenizer, ids).lstrip() == text  # streaming starts with the first word's space


def tokenizer_texts() -> list[str]:
    lines = shakespeare_lines()[-3000:]
    chunks = ["".join(lines[i : i + 3]) for i in range(0, len(lines), 3)]
    return [*chunks[: 1000 - len(NON_ASCII)], *NON_ASCII]


def test_gpt_neox_tokenizer_gives_the_fast_tokenizers_ids_and_text(gpt_neox_folder: Path) -> None:
    _, tokenizer = loaded_generator(gpt_neox_folder)
    assert isinstance(tokenizer, FastTextTokenizer) and tokenizer.byte_level
    hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(gpt_neox_folder)
    texts = tokenizer_texts()
    assert len(texts) == 1000
    batch = tokenizer.encode_batch(texts)
    for text, ids in zip(texts, batch, strict=True):
        assert ids == tokenizer.encode(text) == hf(text, add_special_tokens=False).input_ids, text
        with_specials = [0, *ids, 1, 0]
        assert tokenizer.decode(with_specials) == hf.decode(with_specials, skip_special_tokens=True) == text
        assert streamed(tokenizer, with_specials) == text  # every character whole, though a token may hold part of one
    assert any(len(tokenizer.piece_bytes(i)) and tokenizer.piece_bytes(i)[0] >= 0x80 for ids in batch[-len(NON_ASCII) :] for i in ids)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exports")
    export_hf(DEFAULT_TRANSLATOR, out / "translator")
    export_hf(DEFAULT_GENERATOR, out / "generator")
    return out


def test_exported_translator_loads_back_with_its_logits_and_ids(exports: Path) -> None:
    native, ours = load_native_checkpoint(DEFAULT_TRANSLATOR)
    model, tokenizer = loaded_translator(exports / "translator")
    assert isinstance(tokenizer, MarianTextTokenizer)
    assert [tokenizer.encode(s) for s in ENGLISH[:100]] == [ours.encode(s) for s in ENGLISH[:100]]
    src, tgt = marian_inputs(native, ours, 8)
    with torch.no_grad():
        assert (model(src, tgt) - native(src, tgt)).abs().max() <= ATOL


def test_exported_generator_loads_back_with_its_logits_and_ids(exports: Path) -> None:
    native, ours = load_native_checkpoint(DEFAULT_GENERATOR)
    model, tokenizer = loaded_generator(exports / "generator")
    assert isinstance(tokenizer, FastTextTokenizer) and not tokenizer.byte_level  # sentencepiece-style pieces, byte fallback
    for text in tokenizer_texts()[-50:]:
        ids = tokenizer.encode(text)
        assert ids == ours.encode(text) and tokenizer.decode(ids) == streamed(tokenizer, ids) == text
    ids = torch.tensor([ours.encode("".join(shakespeare_lines()[:30]))[:60]])
    with torch.no_grad():
        assert (model(ids) - native(ids)).abs().max() <= ATOL


def test_sharded_safetensors_and_a_plain_pytorch_bin_load_alike(gpt_neox_folder: Path, tmp_path: Path) -> None:
    sharded = build_gpt_neox_folder(tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("model-*.safetensors"))) > 1
    pickled = tmp_path / "bin"
    shutil.copytree(gpt_neox_folder, pickled)
    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    reference, _ = loaded_generator(gpt_neox_folder)
    ids = torch.randint(0, 800, (2, 16))
    with torch.no_grad():
        for folder in (sharded, pickled):
            assert torch.equal(loaded_generator(folder)[0](ids), reference(ids))
    assert_export_after_load_gives_the_folders_tensors(sharded)


def test_packed_and_int8_models_keep_an_untied_head_and_the_logits_bias(marian_folder: Path, gpt_neox_folder: Path) -> None:
    """Packed: the float32 logits within ATOL; int8: within 5% of the logits' spread on average
    (a dropped bias or head would be off by the whole spread)."""
    translator, tokenizer = loaded_translator(marian_folder)
    generator, _ = loaded_generator(gpt_neox_folder)
    src, tgt = marian_inputs(translator, tokenizer, 4)
    ids = torch.randint(0, 800, (4, 16))
    with torch.no_grad():
        expected = translator(src, tgt), generator(ids)
        for convert in [pack_linear_layers, quantize_weights] if packing_available() else [quantize_weights]:
            t, g = loaded_translator(marian_folder)[0], loaded_generator(gpt_neox_folder)[0]
            convert(t)
            convert(g)
            assert isinstance(g.lm_head, PackedLinear | Int8Linear) and g.output_projection is None
            for got, want in zip([t(src, tgt), g(ids)], expected, strict=True):
                error = (got - want).abs()
                assert error.max() <= ATOL if convert is pack_linear_layers else error.mean() <= 0.05 * want.std(), convert.__name__


def test_unservable_folders_raise_one_line_naming_the_file(marian_folder: Path, gpt_neox_folder: Path, tmp_path: Path) -> None:
    def copy(name: str, source: Path = gpt_neox_folder) -> Path:
        return Path(shutil.copytree(source, tmp_path / name))

    (no_config := copy("no-config")).joinpath("config.json").unlink()
    one_line_error(no_config, "config.json: missing")

    (no_weights := copy("no-weights")).joinpath("model.safetensors").unlink()
    assert "no weights" in one_line_error(no_weights, str(no_weights))

    t5 = copy("t5")
    config = json.loads((t5 / "config.json").read_text())
    (t5 / "config.json").write_text(json.dumps({**config, "architectures": ["T5ForConditionalGeneration"]}))
    assert "T5ForConditionalGeneration" in one_line_error(t5, "config.json: unknown architecture")

    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    one_line_error(truncated, "model.safetensors: unreadable safetensors")

    pickle_only = copy("pickle-only")
    (pickle_only / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"weights": Tokenizer, "marker": marker}, pickle_only / "pytorch_model.bin")  # objects, not tensors
    one_line_error(pickle_only, "pytorch_model.bin: refused: not loadable with weights_only=True")

    renamed = copy("renamed")
    tensors = load_file(str(renamed / "model.safetensors"))
    tensors["gpt_neox.extra.weight"] = tensors.pop("gpt_neox.final_layer_norm.weight")
    torch.save(tensors, renamed / "pytorch_model.bin")
    (renamed / "model.safetensors").unlink()
    one_line_error(renamed, "missing weights: gpt_neox.final_layer_norm.weight")
    del tensors["gpt_neox.extra.weight"]
    tensors["gpt_neox.final_layer_norm.weight"] = torch.ones(64)
    tensors["gpt_neox.extra.weight"] = torch.ones(1)
    torch.save(tensors, renamed / "pytorch_model.bin")
    one_line_error(renamed, "unexpected weights: gpt_neox.extra.weight")
    del tensors["gpt_neox.extra.weight"]
    tensors["gpt_neox.layers.1.attention.query_key_value.weight"] = torch.ones(192, 65)
    torch.save(tensors, renamed / "pytorch_model.bin")
    one_line_error(renamed, "misshapen weights: gpt_neox.layers.1.attention.query_key_value.weight (192, 65) (expected (192, 64))")

    pre_ln = copy("pre-ln", marian_folder)
    config = json.loads((pre_ln / "config.json").read_text())
    (pre_ln / "config.json").write_text(json.dumps({**config, "normalize_before": True}))
    one_line_error(pre_ln, "config.json: normalize_before True is not supported")
