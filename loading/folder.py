"""What a checkpoint folder holds, read from its JSON files alone (no tensor library): the service's
configuration reads it in processes that never load a model.

Two kinds of folder, and a GGUF file (loading/gguf.py reads its header):
- ours (loading.checkpoint): config.json with "architecture" TranslatorConfig or GeneratorConfig;
- Hugging Face's: config.json with "architectures" naming one that loading/hf/registry.py lists
  (MarianMTModel, GPTNeoXForCausalLM, the Llama family), weights as safetensors (one file or
  shards with model.safetensors.index.json) or pytorch_model.bin, and the tokenizer's files. A
  translator's languages come from tokenizer_config.json (source_lang / target_lang).
"""

from dataclasses import dataclass
from pathlib import Path

from loading.folder_base import CheckpointError as CheckpointError
from loading.folder_base import ModelKind as ModelKind
from loading.folder_base import read_json as read_json
from loading.gguf import inspect_gguf
from loading.hf.registry import ADAPTERS, NOT_YET_SUPPORTED

OUR_ARCHITECTURES: dict[str, ModelKind] = {"TranslatorConfig": "translator", "GeneratorConfig": "generator"}
# ISO 639-2/3 codes some opus-mt folders use, to the two-letter codes clients send.
TWO_LETTER = {"eng": "en", "deu": "de", "ger": "de", "fra": "fr", "fre": "fr", "ces": "cs", "cze": "cs", "spa": "es", "ita": "it"}


@dataclass(frozen=True)
class FolderInfo:
    kind: ModelKind
    architecture: str  # ours (TranslatorConfig, GeneratorConfig) or Hugging Face's (MarianMTModel, ...)
    hugging_face: bool
    source_lang: str | None = None  # translators only; None when the folder does not say
    target_lang: str | None = None
    gguf: bool = False  # a GGUF file, not a folder


def language_code(code: str) -> str:
    return TWO_LETTER.get(code.lower(), code.lower())


def inspect_folder(path: Path) -> FolderInfo:
    """The folder's (or GGUF file's) kind, architecture and (translators) languages; CheckpointError
    when it is not one the service can serve."""
    if path.suffix == ".gguf" and not path.is_dir():
        return FolderInfo("generator", inspect_gguf(path).architecture, hugging_face=False, gguf=True)
    if not path.is_dir():
        raise CheckpointError(path, "not a folder")
    config = read_json(path / "config.json")
    if "architecture" in config:
        kind = OUR_ARCHITECTURES.get(config["architecture"])
        if kind is None:
            raise CheckpointError(path / "config.json", f"unknown architecture {config['architecture']!r}")
        if kind == "generator":
            return FolderInfo(kind, config["architecture"], hugging_face=False)
        source, target = config.get("source_lang", "en"), config.get("target_lang", "de")
        return FolderInfo(kind, config["architecture"], False, language_code(source), language_code(target))
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise CheckpointError(path / "config.json", 'names no "architectures" (nor our "architecture")')
    name = str(architectures[0])
    adapter = ADAPTERS.get(name)
    if adapter is None:
        later = " (not supported yet)" if name in NOT_YET_SUPPORTED else ""
        supported = ", ".join(ADAPTERS)
        raise CheckpointError(path / "config.json", f"unknown architecture {name!r}{later}; supported: {supported}")
    if adapter.kind == "generator":
        return FolderInfo(adapter.kind, name, hugging_face=True)
    tokenizer_config = read_json(path / "tokenizer_config.json")
    source, target = (tokenizer_config.get(key) for key in ("source_lang", "target_lang"))
    return FolderInfo(
        adapter.kind,
        name,
        True,
        language_code(source) if isinstance(source, str) else None,
        language_code(target) if isinstance(target, str) else None,
    )
