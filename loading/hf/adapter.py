"""What an adapter declares, and the two directions its name table runs in.

An Adapter maps one family of Hugging Face architectures onto our modules: the architecture names it
reads, the kind of model, how config.json reads as our config (and which tokenizer the folder
has), and its Table: one row (Weight) per Hugging Face tensor, saying which of our tensors it is,
or which rows of one (q, k and v stacked into qkv_proj), and the change of layout between the two
with its inverse (Transform), and the names folders hold that are never read. loading/hf/load.py
runs the table forwards; Table.export runs it backwards, so loading and export cannot disagree.

config.json is read as JSON (transformers stays out of the serving path), absent keys taking the
defaults transformers 5.23's config classes give them. Imports no tensor library: loading/folder.py
reads the registry in processes that never load a model.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from loading.folder_base import CheckpointError, ModelKind, read_json
from loading.tokenizer import TextTokenizer
from model.config import Activation, GeneratorConfig, TranslatorConfig

if TYPE_CHECKING:
    from torch import Tensor

C = TypeVar("C", TranslatorConfig, GeneratorConfig)  # the config an adapter reads

ACTIVATIONS: dict[str, Activation] = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "swish": "silu",
    "silu": "silu",
}
ROPE_SCALINGS = ("default", "linear", "llama3")
BOTH = ("weight", "bias")


@dataclass(frozen=True)
class HFConfig:
    """A folder's config.json (values), as an adapter reads it."""

    folder: Path
    values: dict[str, Any]
    architecture: str  # the name config.json's "architectures" gives first

    def error(self, problem: str) -> CheckpointError:
        return CheckpointError(self.folder / "config.json", problem)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def generation(self) -> dict[str, Any]:
        """generation_config.json, or {} when the folder has none."""
        path = self.folder / "generation_config.json"
        return read_json(path) if path.is_file() else {}

    def token_id(self, key: str, default: int | None = None) -> int | None:
        """A special id; a list (several eos ids) gives its first."""
        value = self.get(key, default)
        if isinstance(value, list):
            value = value[0] if value else None
        return None if value is None else int(value)

    def activation(self, key: str, default: str) -> Activation:
        name = str(self.get(key, default))
        if name not in ACTIVATIONS:
            raise self.error(f"{key} {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[name]

    def rope(self, theta: tuple[str, float], fraction: tuple[str, float]) -> dict[str, Any]:
        """GeneratorConfig's RoPE fields from rope_parameters (transformers 5) or rope_scaling, else
        from the architecture's older top-level keys: theta and fraction name each with its default."""
        rope = self.get("rope_parameters") or self.get("rope_scaling") or {}
        kind = str(rope.get("rope_type", rope.get("type", "default")))
        if kind not in ROPE_SCALINGS:
            raise self.error(f"rope type {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")
        fields: dict[str, Any] = {
            "rope_base": float(rope.get("rope_theta", self.get(*theta))),
            "rotary_fraction": float(rope.get("partial_rotary_factor", self.get(*fraction))),
            "rope_scaling": kind,
        }
        if kind != "default":
            fields["rope_factor"] = float(rope["factor"])
        if kind == "llama3":
            fields["rope_low_freq_factor"] = float(rope["low_freq_factor"])
            fields["rope_high_freq_factor"] = float(rope["high_freq_factor"])
            fields["rope_original_max_len"] = int(rope.get("original_max_position_embeddings", self.get("max_position_embeddings", 2048)))
        return fields


def _same(tensor: "Tensor") -> "Tensor":
    return tensor


@dataclass(frozen=True)
class Transform:
    """A tensor's change of layout from theirs to ours (load) and back (save); shape-only tensor
    methods, so that it runs on the meta device too (load.py reads the expected shapes off it)."""

    load: Callable[["Tensor"], "Tensor"]
    save: Callable[["Tensor"], "Tensor"]


SAME = Transform(_same, _same)


@dataclass(frozen=True)
class Weight:
    """One Hugging Face tensor (theirs) and where it is in our state dict: the rows `rows` of ours
    (all of it, or its slice of a stack), through `transform`."""

    theirs: str
    ours: str
    rows: slice = field(default_factory=lambda: slice(None))  # all of ours
    transform: Transform = SAME


def modules(ours: str, theirs: str, pairs: list[tuple[str, str]], fields: tuple[str, ...] = BOTH) -> list[Weight]:
    """Modules laid out alike in both: for each (our module, their module) of pairs, the fields
    (weight, bias) under the prefixes ours and theirs ("" or ending with a dot)."""
    return [Weight(f"{theirs}{b}.{f}", f"{ours}{a}.{f}") for a, b in pairs for f in fields]


def qkv(ours: str, theirs: str, field: str, rows: list[int]) -> list[Weight]:
    """Their self_attn.q_proj, k_proj and v_proj stacked [q; k; v] into our self_attn.qkv_proj, rows[i] rows each."""
    table, start = [], 0
    for p, n in zip("qkv", rows, strict=True):
        table.append(Weight(f"{theirs}self_attn.{p}_proj.{field}", f"{ours}self_attn.qkv_proj.{field}", slice(start, start + n)))
        start += n
    return table


@dataclass(frozen=True)
class Table(Generic[C]):
    """Their tensors and ours: Weights, less the embedding and output projection (layers), and
    those two by their names; what folders hold that is never read."""

    layers: Callable[[C], list[Weight]]
    embed: str  # their embedding table
    head: str  # their output projection: read when the config unties it, ignored when it ties it
    ignored: re.Pattern[str]  # names folders hold that are never read: buffers and copies the model recomputes
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # other names a folder may hold a tensor under

    def weights(self, config: C) -> list[Weight]:
        """Every tensor of our state dict for config, from theirs."""
        untied: list[Weight] = [] if config.tie_embeddings else [Weight(self.head, "lm_head.weight")]
        return [Weight(self.embed, "embed.weight"), *untied, *self.layers(config)]

    def ignores(self, name: str, config: C) -> bool:
        return self.ignored.fullmatch(name) is not None or (config.tie_embeddings and name == self.head)

    def export(self, config: C, state: dict[str, "Tensor"]) -> dict[str, "Tensor"]:
        """Our state dict (config's) under their names and in their layout, as their folder holds it:
        the inverse of loading. A stack's parts are views of it."""
        return {w.theirs: w.transform.save(state[w.ours][w.rows]).contiguous() for w in self.weights(config)}


@dataclass(frozen=True)
class Adapter(Generic[C]):
    """How a family of Hugging Face architectures maps onto our modules (module doc)."""

    architectures: tuple[str, ...]  # the config.json "architectures" names it reads
    kind: ModelKind
    read: Callable[[HFConfig], tuple[C, TextTokenizer]]  # our config and the folder's tokenizer, or CheckpointError
    table: Table[C]
