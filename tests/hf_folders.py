"""Small Hugging Face folders built with transformers from random weights (no download), with
tokenizers trained here on the shared data: what users bring, shaped as opus-mt and Pythia.

- build_marian_folder: a MarianMTModel with swish, a non-zero final_logits_bias, scaled embeddings,
  decoding from pad, pad never generated (bad_words_ids); separate source.spm (English) and
  target.spm (French) over one vocab.json in an order of its own (shuffled, </s> 0, pad last).
- build_gpt_neox_folder: a GPTNeoXForCausalLM with the parallel residual, rotary on a quarter of
  each head, untied embed_out, and a byte-level BPE tokenizer.json trained on tinyshakespeare.
"""

import io
import json
import random
from pathlib import Path

import sentencepiece as spm
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MarianConfig,
    MarianMTModel,
    MarianTokenizer,
    PreTrainedTokenizerFast,
)

from model.data import SHARED_DATA, read_lines

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
