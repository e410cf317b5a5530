"""Frozen model configurations with named presets; saved as config.json beside the weights."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Self

Positions = Literal["sinusoidal", "rope", "alibi"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]  # gelu: the erf form; gelu_tanh: GPT-2's; silu: swish
SinusoidLayout = Literal["interleaved", "halves"]  # sin/cos at dims 2i/2i+1 (the paper), or sines first (Marian)


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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": type(self).__name__, **dataclasses.asdict(self)}

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
    """Decoder-only, shaped as GPT-NeoX (sequential residual): pre-LN, RoPE, GELU, final LayerNorm."""

    n_layers: int = 4
    norm_first: bool = True
    positions: Positions = "rope"
    activation: Activation = "gelu"
    parallel_residual: bool = False  # x + attn(ln1(x)) + ffn(ln2(x)) (GPT-NeoX, Pythia); else sequential
    rotary_fraction: float = 1.0  # RoPE rotates the first fraction of each head's dims (GPT-NeoX rotary_pct)
    rope_base: float = 10000.0


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
