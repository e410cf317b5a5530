"""Checkpoint folders: config.json, model.safetensors, tokenizer.model, training.json. Nothing is unpickled.

load_checkpoint also reads Hugging Face folders (MarianMT, GPT-NeoX, the Llama family: loading/hf/); which
kind a folder is, loading/folder.py tells from its config.json."""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from loading.folder import inspect_folder
from loading.gguf_load import load_gguf
from loading.hf.load import load_hf_folder
from loading.tokenizer import TextTokenizer, Tokenizer
from model.config import GeneratorConfig, ModelConfig, TranslatorConfig
from model.generator import Generator
from model.paths import DEFAULT_GENERATOR as DEFAULT_GENERATOR
from model.paths import DEFAULT_TRANSLATOR as DEFAULT_TRANSLATOR
from model.quantize import WeightType as WeightType
from model.quantize import place
from model.translator import Translator

Model = Translator | Generator


def build_model(config: ModelConfig) -> Model:
    if isinstance(config, TranslatorConfig):
        return Translator(config)
    if isinstance(config, GeneratorConfig):
        return Generator(config)
    raise TypeError(f"no model for {type(config).__name__}")


def save_checkpoint(
    directory: Path,
    model: Model,
    tokenizer: Tokenizer,
    training: dict[str, Any],
    dtype: torch.dtype | None = None,
) -> None:
    """Writes the folder; dtype (e.g. torch.float16) shrinks the stored weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {name: t.detach().to(dtype or t.dtype).contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    tokenizer.save(directory / "tokenizer.model")
    (directory / "training.json").write_text(json.dumps(training, indent=2) + "\n")


def load_config(directory: Path) -> ModelConfig:
    data = json.loads((directory / "config.json").read_text())
    configs: dict[str, type[ModelConfig]] = {"TranslatorConfig": TranslatorConfig, "GeneratorConfig": GeneratorConfig}
    return configs[data["architecture"]].from_dict(data)


def load_native_checkpoint(
    directory: Path, device: str | torch.device = "cpu", dtype: WeightType = torch.float32
) -> tuple[Model, Tokenizer]:
    """One of our folders: the model in eval mode on device, in dtype (or with quantized weights),
    and its sentencepiece tokenizer."""
    model = build_model(load_config(directory))
    state = load_file(str(directory / "model.safetensors"))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    place(model, device, dtype)
    return model, Tokenizer.load(directory / "tokenizer.model")


def load_checkpoint(directory: Path, device: str | torch.device = "cpu", dtype: WeightType = torch.float32) -> tuple[Model, TextTokenizer]:
    """Our folder or a Hugging Face one (loading.folder.inspect_folder tells which; CheckpointError
    when neither) or a GGUF file: the model in eval mode on device, in dtype (or quantized), and its
    tokenizer. A GGUF file's model keeps its file's weight types (dtype is not applied to it)."""
    info = inspect_folder(directory)
    if info.gguf:
        return load_gguf(directory, device)
    if info.hugging_face:
        return load_hf_folder(directory, device, dtype)
    return load_native_checkpoint(directory, device, dtype)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
