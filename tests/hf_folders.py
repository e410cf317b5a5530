"""Small Hugging Face folders built with transformers from random weights (no download), with
tokenizers trained here on the shared data: what users bring, shaped as opus-mt and Pythia.

- build_marian_folder: a MarianMTModel with swish, a non-zero final_logits_bias, scaled embeddings,
  decoding from pad, pad never generated (bad_words_ids); separate source.spm (English) and
  target.spm (French) over one vocab.json in an order of its own (shuffled, </s> 0, pad last).
- build_gpt_neox_folder: a GPTNeoXForCausalLM with the parallel residual, rotary on a quarter of
  each head, untied embed_out, and a byte-level BPE tokenizer.json trained on tinyshakespeare.
- build_llama_folder: a LlamaForCausalLM shaped as Llama 3 (grouped-query attention, untied
  lm_head, rope_theta 500000, eos and eot as eos ids, bos added by the tokenizer's post-processor,
  a Llama-3-style chat template), or a Qwen2ForCausalLM / MistralForCausalLM, with the variants a
  test asks for (head_dim, attention_bias, RoPE scaling, a tied output).
"""

import io
import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MarianConfig,
    MarianMTModel,
    MarianTokenizer,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from loading.folder import CheckpointError
from loading.hf.load import load_hf_folder
from training.data import SHARED_DATA, read_lines

SENTENCES = 3000  # training sentences per language
MARIAN_SPECIAL = ["</s>", "<unk>"]  # ids 0 and 1, as opus-mt; <pad> is the last id


def _train_sentencepiece(path: Path, lines: list[str], vocab_size: int) -> spm.SentencePieceProcessor:
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, vocab_size=vocab_size, character_coverage=1.0, num_threads=1, minloglevel=2
    )
    path.write_bytes(proto.getvalue())
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def _spread_weights(model: torch.nn.Module) -> None:
    """Larger weights than the init's, so that greedy choices are not near-ties (layer norms and
    the position tables Marian recomputes untouched)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "embed_positions" not in name and "norm" not in name:
                parameter.normal_(0.0, 0.2)


def build_marian_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    source = _train_sentencepiece(path / "source.spm", read_lines(SHARED_DATA / "multi30k" / "train.en.gz")[:SENTENCES], 600)
    target = _train_sentencepiece(path / "target.spm", read_lines(SHARED_DATA / "multi30k" / "train.fr.gz")[:SENTENCES], 600)
    pieces = sorted({sp.id_to_piece(i) for sp in (source, target) for i in range(sp.get_piece_size())} - {"<s>", "</s>", "<unk>"})
    random.Random(0).shuffle(pieces)
    vocab = {piece: i for i, piece in enumerate([*MARIAN_SPECIAL, ">>fr<<", *pieces, "<pad>"])}
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    tokenizer = MarianTokenizer(
        str(path / "source.spm"), str(path / "target.spm"), str(path / "vocab.json"), source_lang="en", target_lang="fr"
    )
    tokenizer.save_pretrained(str(path))
    pad_id = len(vocab) - 1
    config = MarianConfig(
        vocab_size=len(vocab),
        decoder_vocab_size=len(vocab),
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        activation_function="swish",
        max_position_embeddings=128,
        scale_embedding=True,
        pad_token_id=pad_id,
        eos_token_id=0,
        decoder_start_token_id=pad_id,
        forced_eos_token_id=0,
    )
    torch.manual_seed(0)
    model = MarianMTModel(config).eval()
    _spread_weights(model)
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        bad_words_ids=[[pad_id]], decoder_start_token_id=pad_id, eos_token_id=0, pad_token_id=pad_id, max_length=128
    )
    model.save_pretrained(str(path))
    return path


def shakespeare_lines() -> list[str]:
    text = (SHARED_DATA / "tinyshakespeare" / "train.txt").read_text(encoding="utf-8")
    return text.splitlines(keepends=True)


def build_gpt_neox_folder(path: Path, max_shard_size: str | None = None) -> Path:
    """max_shard_size (e.g. "100KB"): the weights as model.safetensors shards with an index."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<|endoftext|>", "<|padding|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(shakespeare_lines()[:5000], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>", pad_token="<|padding|>"
    )
    wrapped.save_pretrained(str(path))
    config = GPTNeoXConfig(
        vocab_size=832,  # more rows than the tokenizer has ids, as Pythia's
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        hidden_act="gelu",
        max_position_embeddings=128,
        use_parallel_residual=True,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config).eval()
    _spread_weights(model)
    model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


LLAMA_SPECIAL = [
    *["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],  # Llama 3's
    *["<|im_start|>", "<|im_end|>"],  # ChatML's (Qwen2)
]
BOS, EOS, EOT = 0, 1, 2  # the ids of the first three
# Llama 3's shape: bos as text, headers, <|eot_id|> after each message; trim_blocks and
# lstrip_blocks shape the unmarked block tags, raise_exception refuses unknown roles.
LLAMA3_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system=false) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% endif %}
"""
CHATML_TEMPLATE = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


@cache
def _byte_level_bpe() -> str:
    """A byte-level BPE over tinyshakespeare with the special tokens first, as JSON."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=LLAMA_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(shakespeare_lines()[:5000], trainer=trainer)
    return str(tokenizer.to_str())


def _save_llama_tokenizer(path: Path, bos: bool, template: str, template_in_config: bool) -> None:
    """bos: prompts start with <|begin_of_text|>, added by a TemplateProcessing post-processor as
    Llama 3's tokenizer.json does (tokenizer_config.json saying nothing of add_bos_token). Saved
    again as AutoTokenizer reads it beside config.json (Qwen2's class sets its own pre-tokenizer
    and normaliser), so that the folder holds what transformers itself would write."""
    tokenizer = Tokenizer.from_str(_byte_level_bpe())
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B", special_tokens=[("<|begin_of_text|>", BOS)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    bos_token, eos_token = LLAMA_SPECIAL[BOS] if bos else None, LLAMA_SPECIAL[EOS]
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos_token, eos_token=eos_token, pad_token=eos_token)
    wrapped.chat_template = template
    wrapped.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(path))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("add_bos_token", "add_eos_token"):
        config.pop(key, None)
    if template_in_config and (path / "chat_template.jinja").is_file():
        config["chat_template"] = (path / "chat_template.jinja").read_text()
        (path / "chat_template.jinja").unlink()
    config_path.write_text(json.dumps(config, indent=1))


def build_llama_folder(
    path: Path,
    architecture: str = "llama",
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    attention_bias: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    tie: bool = False,
    max_positions: int = 128,
    hidden_size: int = 64,
    intermediate_size: int = 128,
) -> Path:
    """architecture "llama", "qwen2" (q/k/v biases, no bos, a ChatML template in
    tokenizer_config.json) or "mistral" (no sliding window); 4 query heads of n_kv_heads key/value
    heads; rope_scaling: rope_parameters' type and its parameters; max_positions: its context;
    hidden_size and intermediate_size: its widths."""
    path.mkdir(parents=True, exist_ok=True)
    qwen2 = architecture == "qwen2"
    common: dict[str, Any] = {
        "vocab_size": 832,  # more rows than the tokenizer has ids
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": n_kv_heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, **(rope_scaling or {})},
        "tie_word_embeddings": tie,
        "bos_token_id": None if qwen2 else BOS,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
    }
    model: torch.nn.Module
    if qwen2:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif architecture == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, head_dim=head_dim, sliding_window=None))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=head_dim, attention_bias=attention_bias))
    torch.manual_seed(0)
    model.eval()
    _spread_weights(model)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.2)  # RMSNorm weights other than ones, so that mapping them shows
    model.generation_config = GenerationConfig(bos_token_id=common["bos_token_id"], eos_token_id=[EOS, EOT], pad_token_id=EOS)
    model.save_pretrained(str(path))
    _save_llama_tokenizer(path, bos=not qwen2, template=CHATML_TEMPLATE if qwen2 else LLAMA3_TEMPLATE, template_in_config=qwen2)
    return path


def one_line_error(folder: Path, names: str) -> str:
    """The CheckpointError loading folder raises: one line, naming `names`."""
    with pytest.raises(CheckpointError) as error:
        load_hf_folder(folder)
    message = str(error.value)
    assert "\n" not in message and names in message, message
    return message
