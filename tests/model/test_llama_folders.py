"""Llama-family Hugging Face folders load exactly into our modules: random LlamaForCausalLM,
Qwen2ForCausalLM and MistralForCausalLM folders built in tests/hf_folders.py (grouped-query
attention, head sizes other than d/H, q/k/v biases, scaled RoPE, tied and untied outputs, two eos
ids) give transformers' logits, through our KV cache too, its greedy outputs, its tokenizer's ids
(bos included) and its rendered chat templates; exported again through the same table they give the
folder's tensors back; the explicit attention path, packed and int8 weights run them; unsupported
options raise a CheckpointError naming them."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from loading.chat_template import ChatTemplateError
from loading.hf.load import load_hf_folder
from loading.hf_tokenizers import FastTextTokenizer
from model.config import GeneratorConfig
from model.generator import Generator
from model.kv_cache import PagedKVCache
from model.packed_linear import pack_linear_layers, packing_available
from model.quantize import quantize_weights
from tests.hf_folders import EOS, EOT, build_llama_folder, one_line_error, shakespeare_lines
from tests.model.test_hf_folders import assert_export_after_load_gives_the_folders_tensors, in_bfloat16, tokenizer_texts
from tests.model.test_models import paged_logits

ATOL = 1e-4
NEW_TOKENS = 20
VARIANTS = {
    "llama": {},  # 4 query heads over 2 key/value heads, untied, rope_theta 500000
    "qwen2-tied": {"architecture": "qwen2", "tie": True},  # q/k/v biases, no o_proj bias, no bos
    "head-dim-mqa": {"head_dim": 24, "n_kv_heads": 1},  # heads wider than 64 / 4, one key/value head
    "attention-bias": {"attention_bias": True, "n_kv_heads": 4},  # Llama's: o_proj biased too
    "rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "rope-llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,  # some wavelengths in the smoothed band
        }
    },
    "mistral": {"architecture": "mistral"},
}
CONVERSATIONS = [
    [{"role": "user", "content": "Who comes here?"}],
    [
        {"role": "system", "content": "You speak as Shakespeare's players speak."},
        {"role": "user", "content": "Good morrow. What news?"},
        {"role": "assistant", "content": "  None, my lord, but that the world's grown honest.  "},
        {"role": "user", "content": "Then is doomsday near. Café, naïve, 🙂"},
    ],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Line one\nline two"}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    return {name: build_llama_folder(root / name, **options) for name, options in VARIANTS.items()}  # type: ignore[arg-type]


def loaded(folder: Path) -> tuple[Generator, FastTextTokenizer]:
    model, tokenizer = load_hf_folder(folder)
    assert isinstance(model, Generator) and isinstance(tokenizer, FastTextTokenizer)
    return model, tokenizer


def prompts(tokenizer: FastTextTokenizer, n: int, length: int) -> torch.Tensor:
    lines = shakespeare_lines()
    return torch.tensor([tokenizer.encode_prompt("".join(lines[-40 * (i + 1) :]))[:length] for i in range(n)])


def test_the_configs_say_what_the_folders_hold(folders: dict[str, Path]) -> None:
    configs = {name: loaded(folder)[0].config for name, folder in folders.items()}
    llama = configs["llama"]
    assert (llama.norm, llama.feed_forward, llama.activation, llama.norm_eps) == ("rmsnorm", "gated", "silu", 1e-5)
    assert (llama.kv_heads, llama.head_dim, llama.rope_base, llama.tie_embeddings) == (2, 16, 500000.0, False)
    assert (llama.qkv_bias, llama.out_bias, llama.ff_bias) == (False, False, False)
    assert llama.eos_ids == (EOS, EOT) and llama.eos_id == EOS
    assert (configs["qwen2-tied"].qkv_bias, configs["qwen2-tied"].out_bias, configs["qwen2-tied"].tie_embeddings) == (True, False, True)
    assert (configs["attention-bias"].qkv_bias, configs["attention-bias"].out_bias) == (True, True)
    assert (configs["head-dim-mqa"].head_dim, configs["head-dim-mqa"].kv_heads) == (24, 1)
    assert (configs["rope-linear"].rope_scaling, configs["rope-linear"].rope_factor) == ("linear", 4.0)
    assert (configs["rope-llama3"].rope_scaling, configs["rope-llama3"].rope_original_max_len) == ("llama3", 64)
    for config in configs.values():  # our checkpoints save and read these configs back
        assert GeneratorConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers_whole_and_through_the_kv_cache(folders: dict[str, Path], variant: str) -> None:
    model, tokenizer = loaded(folders[variant])
    hf = AutoModelForCausalLM.from_pretrained(folders[variant]).eval()
    ids = prompts(tokenizer, 3, 100)  # past the llama3 variant's original 64 positions
    with torch.no_grad():
        full = model(ids)
        assert (full - hf(input_ids=ids).logits).abs().max() <= ATOL
    T = 40
    prefill, steps = paged_logits(model, ids, [T] * 3, ids.shape[1] - T, block_size=16)  # the paged cache, as the engine's
    assert (torch.stack(prefill) - full[:, :T]).abs().max() <= ATOL
    for t, step in enumerate(steps, T):
        assert (step - full[:, t]).abs().max() <= ATOL, t


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_after_load_gives_the_folders_tensors_back(folders: dict[str, Path], variant: str) -> None:
    """q/k/v (grouped-query, biased or not) stacked into qkv_proj and split again, a tied head left out."""
    assert_export_after_load_gives_the_folders_tensors(folders[variant])


def test_a_bfloat16_folder_loads_and_exports_in_bfloat16(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = in_bfloat16(folders["llama"], tmp_path / "bf16")
    assert_export_after_load_gives_the_folders_tensors(folder, torch.bfloat16)
    model, _ = load_hf_folder(folder, "cpu", torch.bfloat16)
    assert {t.dtype for t in [*model.parameters(), *model.buffers()]} == {torch.bfloat16}


def greedy(model: Generator, prompt: list[int]) -> list[int]:
    """Our modules' greedy continuation (no cache) up to any of the eos ids."""
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            out.append(int(model(torch.tensor([prompt + out]))[0, -1].argmax()))
        if out[-1] in model.config.eos_ids:
            break
    return out


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied", "head-dim-mqa"])
def test_greedy_equals_generate(folders: dict[str, Path], variant: str) -> None:
    model, tokenizer = loaded(folders[variant])
    hf = AutoModelForCausalLM.from_pretrained(folders[variant]).eval()
    for prompt in ["ROMEO:\n", "First Citizen:\nWe are", "KING HENRY:\nNow"]:
        ids = tokenizer.encode_prompt(prompt)
        expected = hf.generate(torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS)
        assert ids + greedy(model, ids) == expected[0].tolist()


def test_greedy_stops_at_any_eos_as_generate_does(folders: dict[str, Path]) -> None:
    """The second eos id (eot) made the likeliest next token: both stop there."""
    model, tokenizer = loaded(folders["llama"])
    hf = AutoModelForCausalLM.from_pretrained(folders["llama"]).eval()
    with torch.no_grad():
        for m in (model.lm_head, hf.lm_head):
            assert isinstance(m, torch.nn.Linear)
            m.weight[EOT] = m.weight.std() * 50 * torch.randn(m.weight.shape[1]).sign()
    ids = tokenizer.encode_prompt("ROMEO:\n")
    ours = greedy(model, ids)
    expected = hf.generate(torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS)
    assert ids + ours == expected[0].tolist() and ours[-1] in (EOS, EOT) and len(ours) < NEW_TOKENS


@pytest.mark.parametrize("variant", VARIANTS)
def test_explicit_attention_packed_and_int8_weights(folders: dict[str, Path], variant: str) -> None:
    """The explicit path (the attention inspector's) and packed weights within ATOL of the fused
    float32 logits; int8 within 5% of the logits' spread on average."""
    model, tokenizer = loaded(folders[variant])
    ids = prompts(tokenizer, 4, 32)
    with torch.no_grad():
        fused = model(ids)
        for layer in model.layers:
            layer.self_attn.use_sdpa = False
        assert (model(ids) - fused).abs().max() <= ATOL
        for convert in [pack_linear_layers, quantize_weights] if packing_available() else [quantize_weights]:
            converted = loaded(folders[variant])[0]
            convert(converted)
            error = (converted(ids) - fused).abs()
            assert error.max() <= ATOL if convert is pack_linear_layers else error.mean() <= 0.05 * fused.std(), convert.__name__


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied"])
def test_tokenizer_gives_transformers_ids_with_its_bos(folders: dict[str, Path], variant: str) -> None:
    _, tokenizer = loaded(folders[variant])
    hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folders[variant])
    assert tokenizer.add_bos == (variant == "llama")
    texts = tokenizer_texts()
    for text, ids in zip(texts, tokenizer.encode_batch(texts), strict=True):
        assert tokenizer.encode_prompt(text) == hf(text).input_ids, text
        assert ids == tokenizer.encode(text) == hf(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(tokenizer.encode_prompt(text)) == hf.decode(hf(text).input_ids, skip_special_tokens=True) == text


def test_the_post_processor_decides_bos_as_in_transformers(folders: dict[str, Path], tmp_path: Path) -> None:
    """transformers 5.23 adds bos when tokenizer.json's post-processor does, whatever
    tokenizer_config.json's add_bos_token says."""
    texts = tokenizer_texts()[:50]
    for name, add_bos, keep_post_processor in [("off", False, True), ("on", True, False), ("unsaid", None, False)]:
        folder = Path(shutil.copytree(folders["llama"], tmp_path / name))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **({} if add_bos is None else {"add_bos_token": add_bos})}))
        if not keep_post_processor:
            spec = json.loads((folder / "tokenizer.json").read_text())
            (folder / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": None}))
        _, tokenizer = loaded(folder)
        hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.add_bos == keep_post_processor, name
        assert [tokenizer.encode_prompt(text) for text in texts] == [hf(text).input_ids for text in texts], name


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied"])
def test_render_chat_equals_apply_chat_template(folders: dict[str, Path], variant: str) -> None:
    """Llama's template from chat_template.jinja, Qwen2's (ChatML) from tokenizer_config.json."""
    _, tokenizer = loaded(folders[variant])
    assert (folders[variant] / "chat_template.jinja").is_file() == (variant == "llama")
    hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folders[variant])
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert tokenizer.render_chat(messages, add_generation_prompt) == expected
        rendered = tokenizer.render_chat(messages)
        expected_ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert tokenizer.encode(rendered) == expected_ids  # special tokens written as text read as themselves
    sent = pickle.loads(pickle.dumps(tokenizer))  # as the engine's process sends it to its replica
    assert [sent.render_chat(m) for m in CONVERSATIONS] == [tokenizer.render_chat(m) for m in CONVERSATIONS]
    assert [sent.encode_prompt(t) for t in ("Who comes here?", "")] == [tokenizer.encode_prompt(t) for t in ("Who comes here?", "")]


def test_chat_template_errors_are_clear(folders: dict[str, Path], tmp_path: Path) -> None:
    _, tokenizer = loaded(folders["llama"])
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tokenizer.render_chat([{"role": "tool", "content": "42"}])
    folder = Path(shutil.copytree(folders["llama"], tmp_path / "no-template"))
    (folder / "chat_template.jinja").unlink()
    _, plain = loaded(folder)
    assert plain.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.render_chat(CONVERSATIONS[0])


def test_kv_cache_bytes_per_token_shrink_with_the_key_value_heads() -> None:
    per_token = {}
    for kv_heads in (4, 2, 1):
        config = GeneratorConfig(d_model=64, n_heads=4, n_kv_heads=kv_heads, n_layers=2, max_len=32)
        per_token[kv_heads] = PagedKVCache.block_bytes(
            config.n_layers, 1, config.kv_heads, config.head_dim, torch.float32
        )  # a block of 1 token
    assert per_token == {4: 2 * 2 * 4 * 16 * 4, 2: 2 * 2 * 2 * 16 * 4, 1: 2 * 2 * 1 * 16 * 4}  # layers x (k, v) x heads x D x float32


def test_unsupported_llama_options_raise_one_line_naming_them(folders: dict[str, Path], tmp_path: Path) -> None:
    def with_config(name: str, **changes: object) -> Path:
        folder = Path(shutil.copytree(folders["llama"], tmp_path / name))
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return folder

    yarn = with_config("yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    one_line_error(yarn, "config.json: rope type 'yarn' is not supported")
    window = with_config("window", architectures=["MistralForCausalLM"], sliding_window=16)
    one_line_error(window, "config.json: sliding-window attention (sliding_window 16)")
    spm_only = with_config("spm-only")
    (spm_only / "tokenizer.json").rename(spm_only / "tokenizer.model")
    one_line_error(spm_only, "tokenizer.json: missing: a sentencepiece tokenizer.model alone is not supported")
    broken = with_config("broken-template")
    (broken / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }")
    one_line_error(broken, "chat_template.jinja: the chat template does not compile")
