"""A Hugging Face folder loaded into our modules, its weights streamed from the files into a model
built without them: the checkpoint is never held whole, nor copied to float32 on the way.

The folder's adapter (loading/hf/registry.py, by config.json's architecture) reads its config and
tokenizer. The model is built with its parameters on the meta device (no memory, no random
initialisation) and its buffers real (the position tables it computes at init); each parameter is
then allocated on the device in the target dtype and filled through the adapter's table, tensor by
tensor, a large one CHUNK_BYTES at a time. The peak is the model's own bytes plus about a chunk or a
transformed tensor (benchmarks/load_memory.py measures it).

Weights come from model.safetensors, from the shards a model.safetensors.index.json lists, or from
pytorch_model.bin through torch.load(weights_only=True), which unpickles tensors and nothing else
(read whole: there the peak adds the file).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode

from loading.folder import CheckpointError, inspect_folder, read_json
from loading.hf.adapter import SAME, HFConfig, Table, Weight
from loading.hf.registry import ADAPTERS
from loading.tokenizer import TextTokenizer
from model.config import GeneratorConfig, TranslatorConfig
from model.generator import Generator
from model.quantize import WeightType, place
from model.translator import Translator

CHUNK_BYTES = 16 << 20  # a tensor is read this much at a time (rows of it), unless it is transformed
FIRST_FEW = 5


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _first_few(names: list[str]) -> str:
    more = f" and {len(names) - FIRST_FEW} more" if len(names) > FIRST_FEW else ""
    return ", ".join(names[:FIRST_FEW]) + more


@dataclass(frozen=True)
class WeightFile:
    """One file of a folder's weights: its tensors' shapes by name, read a block of rows at a time."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    tensors: dict[str, Tensor] | None = None  # pytorch_model.bin's, read whole; a safetensors file is read at each call

    def read(self, name: str, rows: slice = slice(None)) -> Tensor:
        if self.tensors is not None:
            return self.tensors[name][rows]
        try:
            with safe_open(self.path, "pt") as f:  # for this read alone: a mapped file's pages count as ours until it closes
                return f.get_slice(name)[rows]
        except (SafetensorError, OSError) as error:
            raise CheckpointError(self.path, f"unreadable safetensors ({_one_line(error)})") from None


def _safetensors(path: Path) -> WeightFile:
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        with safe_open(path, "pt") as f:
            names = f.keys()
            return WeightFile(path, {name: tuple(f.get_slice(name).get_shape()) for name in names})
    except (SafetensorError, OSError) as error:
        raise CheckpointError(path, f"unreadable safetensors ({_one_line(error)})") from None


def _pickle(path: Path) -> WeightFile:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an UnpicklingError for pickled objects; a broken archive raises others
        raise CheckpointError(path, f"refused: not loadable with weights_only=True ({type(error).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(path, "not a state dict of tensors")
    return WeightFile(path, {name: tuple(t.shape) for name, t in state.items()}, state)


def weight_files(folder: Path) -> tuple[list[WeightFile], Path]:
    """The folder's weight files, and the file that names them (for messages)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [_safetensors(single)], single
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, 'has no "weight_map"')
        return [_safetensors(folder / shard) for shard in sorted(set(map(str, weight_map.values())))], index
    if (folder / "pytorch_model.bin").is_file():
        return [_pickle(folder / "pytorch_model.bin")], folder / "pytorch_model.bin"
    raise CheckpointError(folder, "no weights: none of model.safetensors, model.safetensors.index.json, pytorch_model.bin")


def _plan(
    table: Table[Any], config: TranslatorConfig | GeneratorConfig, files: list[WeightFile], source: Path, shapes: dict[str, Any]
) -> dict[str, Weight]:
    """The table's Weights by the name each is read under (an alias where the folder uses one),
    checked against the folder: CheckpointError naming the first few missing, unexpected or
    misshapen tensors. shapes: our state dict's."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    expected = {name: tuple(t.shape) for name, t in table.export(config, meta).items()}
    found = {name: shape for file in files for name, shape in file.shapes.items()}
    weights = {w.theirs: w for w in table.weights(config)}
    for name, aliases in table.aliases.items():
        alias = next((a for a in aliases if a in found), None)
        if name not in found and alias is not None:
            weights[alias], expected[alias] = replace(weights.pop(name), theirs=alias), expected.pop(name)
    missing = [name for name in weights if name not in found]
    if missing:
        raise CheckpointError(source, f"missing weights: {_first_few(missing)}")
    unexpected = sorted(name for name in found if name not in weights and not table.ignores(name, config))
    if unexpected:
        raise CheckpointError(source, f"unexpected weights: {_first_few(unexpected)}")
    misshapen = [f"{name} {found[name]} (expected {expected[name]})" for name in weights if found[name] != expected[name]]
    if misshapen:
        raise CheckpointError(source, f"misshapen weights: {_first_few(misshapen)}")
    return weights


def _fill(destination: Tensor, file: WeightFile, name: str, weight: Weight) -> None:
    """destination (ours, or a stack's rows of it) from the file's tensor `name`: about CHUNK_BYTES
    of rows at a time, or whole through a transform."""
    if weight.transform is not SAME:
        destination.copy_(weight.transform.load(file.read(name)))
        return
    step = max(1, CHUNK_BYTES // (destination[0].numel() * destination.element_size()))
    for start in range(0, len(destination), step):
        destination[start : start + step].copy_(file.read(name, slice(start, start + step)))


class _NoWritesToMeta(TorchFunctionMode):
    """In-place ops on meta tensors do nothing: they store nothing there anyway, and normal_ would have
    torch import its Python meta kernels (some 800 modules, 70 MB) to check its arguments."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        written = args[0] if args else kwargs.get("tensor")  # a method's self, or what an nn.init function fills
        if getattr(func, "__name__", "").endswith("_") and isinstance(written, Tensor) and written.is_meta:
            return written
        return func(*args, **kwargs)


def _on_meta(_module: nn.Module, _name: str, parameter: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(parameter.to("meta"), parameter.requires_grad)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (no memory; their random
    initialisation is skipped) and their buffers as usual, so that what a model computes at init
    (position tables) is real. The hook is global: no other thread may build modules meanwhile."""
    hook = register_module_parameter_registration_hook(_on_meta)  # type: ignore[arg-type]  # the stub says None; torch takes a returned parameter
    try:
        with _NoWritesToMeta():
            yield
    finally:
        hook.remove()


def load_hf_folder(
    folder: Path, device: str | torch.device = "cpu", dtype: WeightType = torch.float32
) -> tuple[Translator | Generator, TextTokenizer]:
    """The folder's model in eval mode on device, in dtype (or with quantized weights), and its
    tokenizer; CheckpointError when it cannot be served."""
    info = inspect_folder(folder)
    if not info.hugging_face:
        raise CheckpointError(folder / "config.json", "not a Hugging Face folder")
    adapter = ADAPTERS[info.architecture]
    config: TranslatorConfig | GeneratorConfig
    config, tokenizer = adapter.read(HFConfig(folder, read_json(folder / "config.json"), info.architecture))
    if isinstance(config, TranslatorConfig):
        config = replace(config, source_lang=info.source_lang or config.source_lang, target_lang=info.target_lang or config.target_lang)
    files, source = weight_files(folder)
    with parameters_on_meta():
        model = Translator(config) if isinstance(config, TranslatorConfig) else Generator(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    weights = _plan(adapter.table, config, files, source, shapes)
    placed = dtype if isinstance(dtype, torch.dtype) else torch.float32  # quantized from float32
    state = {name: torch.empty(shape, dtype=placed, device=device) for name, shape in shapes.items()}
    with torch.no_grad():
        for file in files:
            for name in [name for name in file.shapes if name in weights]:
                weight = weights[name]
                _fill(state[weight.ours][weight.rows], file, name, weight)
    model.load_state_dict(state, assign=True)
    place(model, device, dtype)  # the buffers: to device, in dtype; or quantized
    return model, tokenizer
