"""Frozen model configurations with named presets; saved as config.json beside the weights."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Self

Positions = Literal["sinusoidal", "rope", "alibi"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]  # gelu: the erf form; gelu_tanh: GPT-2's; silu: swish
SinusoidLayout = Literal["interleaved", "halves"]  # sin/cos at dims 2i/2i+1 (the paper), or sines first (Marian)
Norm = Literal["layernorm", "rmsnorm"]  # RMSNorm (Llama): no mean subtracted, no bias
FeedForwardKind = Literal["mlp", "gated"]  # fc2(act(fc1 x)), or fc2(act(fc1 x) * up(x)): SwiGLU with silu (Llama)
RopeScaling = Literal["default", "linear", "llama3"]  # transformers' rope_type: how inv_freq is rescaled
Quantization = Literal["int8", "q8_0", "q4_0", "q4_1"]  # linear layers in GGUF block types at load (model/quantize.py)
# Fields added after the shipped checkpoints were written: config.json holds them only when set, so
# that rewriting an earlier config (averaging, continued training) gives the same file.
LATER_FIELDS = frozenset(
    {
        "extra_eos_ids",
        "rope_scaling",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_len",
        "rope_freq_factors",
        "norm",
        "feed_forward",
        "n_kv_heads",
        "head_size",
        "qkv_bias",
        "out_bias",
        "ff_bias",
    }
)


@dataclass(frozen=True)
class ModelConfig:
    """Fields shared by both architectures. Special ids come from the checkpoint (our tokenizers fix
    pad 0, unk 1, bos 2, eos 3; a Hugging Face folder's config says its own)."""

    vocab_size: int = 8000
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.1
    activation: Activation = "relu"
    norm_first: bool = False  # pre-LN if True, post-LN (the original paper) if False
    positions: Positions = "sinusoidal"
    max_len: int = 256  # longest sequence (tokens) positions and caches are sized for
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3
    suppressed_ids: tuple[int, ...] = ()  # never generated (Marian's pad: its bad_words_ids)
    norm_eps: float = 1e-5  # every LayerNorm's epsilon
    tie_embeddings: bool = True  # the output projection is the embedding table; else its own matrix (lm_head)
    extra_eos_ids: tuple[int, ...] = ()  # ids that end a sequence besides eos_id (Llama 3's <|eot_id|>)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence, eos_id first."""
        return (self.eos_id, *self.extra_eos_ids)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: what a KV cache holds per layer (fewer than n_heads with grouped-query attention)."""
        return self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """Every field, but those of LATER_FIELDS only when they differ from their defaults."""
        defaults = dataclasses.asdict(type(self)())
        values = {k: v for k, v in dataclasses.asdict(self).items() if k not in LATER_FIELDS or v != defaults[k]}
        return {"architecture": type(self).__name__, **values}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields
        }  # JSON lists back to tuples
        return cls(**values)

    @classmethod
    def preset(cls, name: str) -> Self:
        presets: dict[str, ModelConfig] = PRESETS[cls.__name__]
        if name not in presets:
            raise KeyError(f"unknown {cls.__name__} preset {name!r}; choose from {sorted(presets)}")
        return cls.from_dict(dataclasses.asdict(presets[name]))


@dataclass(frozen=True)
class TranslatorConfig(ModelConfig):
    """Encoder-decoder, shaped as MarianMT: post-LN, sinusoidal positions, shared scaled embeddings."""

    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    source_lang: str = "en"
    target_lang: str = "de"
    decoder_start_id: int | None = None  # the decoder's first input; None: bos_id (Marian's own models start from pad)
    scale_embedding: bool = True  # embeddings times sqrt(d_model)
    logits_bias: bool = False  # a learned bias on the output logits (Marian's final_logits_bias)
    sinusoid_layout: SinusoidLayout = "interleaved"

    @property
    def start_id(self) -> int:
        return self.bos_id if self.decoder_start_id is None else self.decoder_start_id


@dataclass(frozen=True)
class GeneratorConfig(ModelConfig):
    """Decoder-only, shaped as GPT-NeoX (sequential residual): pre-LN, RoPE, GELU, final LayerNorm.

    The defaults are GPT-NeoX's; a Llama-style model (Llama, Qwen2, Mistral) sets norm "rmsnorm",
    feed_forward "gated" with silu (SwiGLU), no biases (or q/k/v biases only: Qwen2), grouped-query attention
    (n_kv_heads), its own head_size, and RoPE scaling."""

    n_layers: int = 4
    norm_first: bool = True
    positions: Positions = "rope"
    activation: Activation = "gelu"
    parallel_residual: bool = False  # x + attn(ln1(x)) + ffn(ln2(x)) (GPT-NeoX, Pythia); else sequential
    rotary_fraction: float = 1.0  # RoPE rotates the first fraction of each head's dims (GPT-NeoX rotary_pct)
    rope_base: float = 10000.0  # RoPE's theta
    rope_scaling: RopeScaling = "default"
    rope_factor: float = 1.0  # linear and llama3: inv_freq divided by it (llama3: the low frequencies only)
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_len / this are divided by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: below original_max_len / this they are kept; smoothed between
    rope_original_max_len: int = 8192  # llama3: the context length the model was pretrained at
    # Each RoPE frequency (R/2 of them) divided by its own factor after rope_scaling: a GGUF file's
    # rope_freqs tensor (llama.cpp's form of Llama 3.1's scaling); () divides by none.
    rope_freq_factors: tuple[float, ...] = ()
    norm: Norm = "layernorm"
    feed_forward: FeedForwardKind = "mlp"
    n_kv_heads: int | None = None  # grouped-query attention: key/value heads, each shared by n_heads / n_kv_heads queries; None: n_heads
    head_size: int | None = None  # each head's width when not d_model / n_heads (q/k/v/o projections sized by it)
    qkv_bias: bool = True  # biases on the query, key and value projections
    out_bias: bool = True  # a bias on the attention output projection
    ff_bias: bool = True  # biases on the feed-forward layers (Llama's mlp_bias)

    def __post_init__(self) -> None:
        assert self.n_heads % self.kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        rotated_pairs = int(self.head_dim * self.rotary_fraction) // 2
        assert not self.rope_freq_factors or len(self.rope_freq_factors) == rotated_pairs, "one rope_freq_factor per rotated pair"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


PRESETS: dict[str, dict[str, ModelConfig]] = {
    "TranslatorConfig": {
        "multi30k-small": TranslatorConfig(vocab_size=8000, d_model=256, n_heads=4, d_ff=1024),
        "tiny": TranslatorConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, max_len=64),
    },
    "GeneratorConfig": {
        "shakespeare-small": GeneratorConfig(vocab_size=2000, d_model=256, n_heads=4, d_ff=1024, n_layers=6, dropout=0.2),
        "tiny": GeneratorConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=64),
    },
}
