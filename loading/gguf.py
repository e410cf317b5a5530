"""GGUF files (llama.cpp's format) served as they are downloaded: one file holds the architecture,
hyperparameters, tokenizer, chat template and weights.

- Architectures: the Llama family (general.architecture llama, mistral, qwen2) as our Generator.
  llama.cpp's converter interleaves the rotary halves of a llama/mistral file's q and k rows; their
  rows are put back in the rotate-half order our attention (and transformers) use. qwen2 files keep it.
- Tensors: Q8_0, Q4_0, Q4_1 and the k-quants Q4_K, Q5_K, Q6_K (a Q4_K_M file's) stay in their
  blocks (model/block_quant.py), read as they lie in the file; F32, F16 and BF16 become float32
  layers. q, k and v in one type are stacked as one layer, in several types (a Q4_K_M file's mix)
  as parts. The file is memory-mapped (copy-on-write) and
  the model's tensors are its pages where they need no change (every quantized matrix, F32 ones):
  loading copies only the stacked q/k/v and converted F16/BF16 tensors.
- Tokenizer: tokenizer.ggml.model "gpt2" (byte-level BPE: tokens, merges, the pre-tokenizer that
  tokenizer.ggml.pre names) or "llama" (SentencePiece: tokens and scores, merges derived from the
  scores, byte fallback), built as a tokenizer.json for the `tokenizers` library; special tokens
  from token_type (control) and the *_token_id keys; tokenizer.chat_template.

RoPE: rope.freq_base, linear rope.scaling, and a rope_freqs tensor (llama.cpp's form of Llama 3.1's
scaling: each frequency's divisor) as GeneratorConfig.rope_freq_factors.

Anything else (another architecture, a tensor type such as Q2_K or IQ4_XS, another vocabulary, rope
scaling other than these, a truncated or foreign file, missing keys) is refused with a
CheckpointError naming it, at configuration time (inspect_gguf) where it can be told from the header.
This module reads the header and imports no tensor library (the service's configuration reads it in
processes that never load a model); loading/gguf_load.py builds the model.
"""

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from loading.folder_base import CheckpointError
from loading.hf_tokenizers import FastTextTokenizer, byte_level_alphabet
from model.config import GeneratorConfig

ARCHITECTURES = ("llama", "mistral", "qwen2")
BLOCK = 32  # weights in a block of every quantized type read here (model/block_quant.py)
INTERLEAVED_ROPE = ("llama", "mistral")  # llama.cpp's converter permuted their q and k rows
F32, F16, BF16 = 0, 1, 30  # ggml's type ids
FLOAT_TYPES = {F32: "F32", F16: "F16", BF16: "BF16"}
SUPPORTED_TYPES = {**FLOAT_TYPES, 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
SUPER_BLOCK_TYPES = (12, 13, 14)  # the k-quants: 256 weights a block
TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values
REQUIRED_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id")
# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) as the regexes it splits text with before BPE.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [GPT2_SPLIT],
    "gpt-2": [GPT2_SPLIT],
    "smollm": [r"\p{N}", GPT2_SPLIT],
    "llama-bpe": [LLAMA3_SPLIT],
    "llama3": [LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT],
}


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensors (memory-mapped by the gguf package's reader)."""

    path: Path
    reader: Any  # gguf.GGUFReader

    def error(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, problem)

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise self.error(f"missing metadata key {key}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def arch(self, key: str, default: Any = None) -> Any:
        """The architecture's own key (llama.block_count ...)."""
        return self.get(f"{self.architecture}.{key}", default)

    @cached_property
    def tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self.reader.tensors}


def open_gguf(path: Path) -> GGUFFile:
    """The file's header read (CheckpointError for a file that is no GGUF, or a truncated one)."""
    import gguf  # the GGUF package: only where a GGUF file is read

    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        return GGUFFile(path, gguf.GGUFReader(path, "c"))  # copy-on-write: the model's tensors can be the file's pages
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError) as error:
        raise CheckpointError(path, f"not a readable GGUF file ({' '.join(str(error).split())[:200]})") from None


def check_gguf(file: GGUFFile) -> None:
    """CheckpointError naming the first thing the file holds that the service cannot serve."""
    if file.architecture not in ARCHITECTURES:
        raise file.error(f"architecture {file.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    for key in REQUIRED_TOKENIZER_KEYS:
        file.require(key)
    model = file.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise file.error(f"tokenizer.ggml.model {model!r} is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece)")
    if model == "gpt2" and file.get("tokenizer.ggml.merges") is None:
        raise file.error("missing metadata key tokenizer.ggml.merges")
    if model == "llama" and file.get("tokenizer.ggml.scores") is None:
        raise file.error("missing metadata key tokenizer.ggml.scores")
    pre = str(file.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise file.error(f"tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    scaling = file.arch("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise file.error(f"rope scaling {scaling!r} is not supported; supported: none, linear")
    if "rope_freqs.weight" in file.tensors and int(file.tensors["rope_freqs.weight"].tensor_type) != F32:
        raise file.error("tensor rope_freqs.weight is not F32")
    for tensor in file.reader.tensors:
        kind = int(tensor.tensor_type)
        if kind not in SUPPORTED_TYPES:
            name = getattr(tensor.tensor_type, "name", str(kind))
            raise file.error(f"tensor {tensor.name} has type {name}; supported: {', '.join(SUPPORTED_TYPES.values())}")
        width = 256 if kind in SUPER_BLOCK_TYPES else BLOCK
        if kind not in FLOAT_TYPES and int(tensor.shape[0]) % width:
            raise file.error(f"tensor {tensor.name}: {int(tensor.shape[0])} columns, not a multiple of {width}")
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in file.tensors:
            raise file.error(f"missing tensor {name}")
    read_config(file)  # the hyperparameters, and rope_freqs' factors


def inspect_gguf(path: Path) -> GGUFFile:
    """The file opened and checked: CheckpointError when the service cannot serve it."""
    file = open_gguf(path)
    check_gguf(file)
    return file


def read_config(file: GGUFFile) -> GeneratorConfig:
    """The file's hyperparameters as our GeneratorConfig (absent keys take llama.cpp's defaults)."""
    a = file.arch
    d_model, n_heads = int(a("embedding_length") or 0), int(a("attention.head_count") or 0)
    if not d_model or not n_heads or a("block_count") is None or a("feed_forward_length") is None:
        raise file.error(f"missing {file.architecture}.embedding_length, block_count, feed_forward_length or attention.head_count")
    head_dim = int(a("attention.key_length") or d_model // n_heads)
    rope_dims = int(a("rope.dimension_count") or head_dim)
    eos = int(file.require("tokenizer.ggml.eos_token_id"))
    extra_eos = tuple(
        int(i) for key in ("eot_token_id", "eom_token_id") if (i := file.get(f"tokenizer.ggml.{key}")) is not None and int(i) != eos
    )

    def token_id(key: str) -> int:
        return int(file.get(f"tokenizer.ggml.{key}", eos))

    linear = a("rope.scaling.type", "none") == "linear"
    rope_freq_factors: tuple[float, ...] = ()
    if "rope_freqs.weight" in file.tensors:  # Llama 3.1's scaling as llama.cpp writes it: each frequency's divisor
        rope_freq_factors = tuple(float(x) for x in file.tensors["rope_freqs.weight"].data.reshape(-1).tolist())
        if len(rope_freq_factors) != rope_dims // 2 or not all(0 < x < float("inf") for x in rope_freq_factors):
            raise file.error(f"tensor rope_freqs.weight: expected {rope_dims // 2} positive factors, one per rotated pair")
    return GeneratorConfig(
        vocab_size=len(file.require("tokenizer.ggml.tokens")),
        d_model=d_model,
        n_heads=n_heads,
        d_ff=int(a("feed_forward_length")),
        dropout=0.0,
        activation="silu",
        max_len=int(a("context_length") or 2048),
        pad_id=token_id("padding_token_id"),
        unk_id=token_id("unknown_token_id"),
        bos_id=token_id("bos_token_id"),
        eos_id=eos,
        extra_eos_ids=tuple(dict.fromkeys(extra_eos)),
        norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in file.tensors,
        n_layers=int(a("block_count")),
        rotary_fraction=rope_dims / head_dim,
        rope_base=float(a("rope.freq_base", 10000.0)),
        rope_scaling="linear" if linear else "default",
        rope_factor=float(a("rope.scaling.factor", 1.0)) if linear else 1.0,
        rope_freq_factors=rope_freq_factors,
        norm="rmsnorm",
        feed_forward="gated",
        n_kv_heads=int(a("attention.head_count_kv") or n_heads),
        head_size=head_dim,
        qkv_bias="blk.0.attn_q.bias" in file.tensors,
        out_bias="blk.0.attn_output.bias" in file.tensors,
        ff_bias=False,
    )


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[str]:
    """BPE merges implied by a SentencePiece vocabulary and its scores, as llama.cpp's tokenizer
    merges (the pair whose merged token scores highest first; transformers' generate_merges)."""
    ids = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        merges += [(left, right, score) for left, right in sorted(pairs, key=lambda pair: (ids[pair[0]], ids[pair[1]]))]
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [f"{left} {right}" for left, right, _ in merges]


def _byte_level_parts(file: GGUFFile, tokens: list[str]) -> dict[str, Any]:
    """A gpt2 vocabulary's tokenizer.json parts: split by the pre-tokenizer's regexes, bytes as characters."""
    splits = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in PRE_TOKENIZERS[str(file.get("tokenizer.ggml.pre", "default"))]
    ]
    return {
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [*splits, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}],
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "merges": [str(m) for m in file.require("tokenizer.ggml.merges")],
            "byte_fallback": False,
            "fuse_unk": False,
            "unk_token": None,
        },
    }


def _sentencepiece_parts(file: GGUFFile, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """A llama (SentencePiece) vocabulary's tokenizer.json parts, as transformers' Llama converter
    writes them: a word mark before the text and for every space, bytes by <0xNN> fallback pieces."""
    unknown = next((tokens[i] for i, kind in enumerate(types) if kind == TOKEN_UNKNOWN), None)
    return {
        "normalizer": {
            "type": "Sequence",
            "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}],
        },
        "pre_tokenizer": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "merges": sentencepiece_merges(tokens, [float(x) for x in file.require("tokenizer.ggml.scores")]),
            "byte_fallback": True,
            "fuse_unk": True,
            "unk_token": unknown,
        },
    }


def read_tokenizer(file: GGUFFile) -> FastTextTokenizer:
    """The file's vocabulary (gpt2: byte-level BPE; llama: SentencePiece) as a tokenizer.json for
    the `tokenizers` library."""
    tokens = [str(t) for t in file.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in file.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    byte_level = file.get("tokenizer.ggml.model") == "gpt2"
    alphabet = set(byte_level_alphabet())
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == TOKEN_CONTROL,
        }
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or (byte_level and not set(token) <= alphabet)
    ]
    parts = _byte_level_parts(file, tokens) if byte_level else _sentencepiece_parts(file, tokens, types)
    bos = file.get("tokenizer.ggml.bos_token_id")
    adds_bos = bos is not None and bool(file.get("tokenizer.ggml.add_bos_token", not byte_level))
    post = None
    if adds_bos:
        bos_token = tokens[int(bos)]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [int(bos)], "tokens": [bos_token]}},
        }
    model = parts.pop("model")
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        **parts,
        "post_processor": post,
        "model": {
            "type": "BPE",
            "dropout": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            **model,
        },
    }
    special = {
        name: tokens[int(i)]
        for name, key in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")]
        if (i := file.get(f"tokenizer.ggml.{key}")) is not None
    }
    template = file.get("tokenizer.chat_template")
    return FastTextTokenizer.from_spec(spec, special, template if isinstance(template, str) else None, file.path)
