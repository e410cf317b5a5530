"""Frozen model configurations with named presets; saved as config.json beside the weights."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Self

Positions = Literal["sinusoidal", "rope", "alibi"]
Activation = Literal["relu", "gelu"]


@dataclass(frozen=True)
class ModelConfig:
    """Fields shared by both architectures. Special token ids are fixed by the tokenizers."""

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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": type(self).__name__, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

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


@dataclass(frozen=True)
class GeneratorConfig(ModelConfig):
    """Decoder-only, shaped as GPT-NeoX (sequential residual): pre-LN, RoPE, GELU, final LayerNorm."""

    n_layers: int = 4
    norm_first: bool = True
    positions: Positions = "rope"
    activation: Activation = "gelu"


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
