"""GGUF files served as they are: Llama-family folders (tests/hf_folders.py) written by exports.gguf
in each supported type load into our Generator with the logits and greedy outputs transformers
gives for the same file (`gguf_file=`, which dequantizes it), the folder tokenizer's ids, their
matrices kept in blocks; the block kernels compute what the gguf package's dequantizer says; files
the service cannot serve are refused with one line naming the problem."""

import ctypes
import io
import platform
import shutil
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoding.sampling_params import GREEDY
from exports.gguf import export_gguf
from loading.checkpoint import load_checkpoint
from loading.folder import CheckpointError, inspect_folder
from loading.gguf_load import load_gguf
from loading.hf.load import load_hf_folder
from model import block_quant, cpu_kernels
from model.block_quant import BLOCK_BYTES, BlockEmbedding, BlockLinear, ConcatenatedLinear, block_product, dequantize, dequantize_rows
from model.generator import Generator
from model.packed_linear import pack_linear_layers, packing_available
from model.quantize import Int8Linear
from service.config import ModelServingConfig
from service.engine.offline import OfflineEngine
from service.engine.request import GenerationParams
from tests.hf_folders import build_llama_folder, shakespeare_lines

TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]
QUANTIZED = {"Q8_0": block_quant.Q8_0, "Q4_0": block_quant.Q4_0, "Q4_1": block_quant.Q4_1}
NEW_TOKENS = 16
TEXTS = [
    "To be, or not to be: that is the question.",
    "ROMEO:\nWhat light through yonder window 1234 breaks?",
    "Café déjà vu 🙂 <|im_end|>",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-folders")
    return {
        "llama": build_llama_folder(root / "llama"),  # untied, bos, interleaved q/k rows in the file
        "qwen2": build_llama_folder(root / "qwen2", architecture="qwen2", tie=True),  # q/k/v biases, tied, no bos
    }


@pytest.fixture(scope="module")
def files(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("gguf-files")
    return {(name, kind): export_gguf(folder, root / f"{name}-{kind}.gguf", kind) for name, folder in folders.items() for kind in TYPES}


def transformers_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_gguf_logits_and_greedy_outputs_equal_transformers_on_the_same_file(
    files: dict[tuple[str, str], Path], folders: dict[str, Path], name: str, kind: str
) -> None:
    path = files[name, kind]
    model, tokenizer = load_gguf(path)
    _, folder_tokenizer = load_hf_folder(folders[name])
    reference = transformers_model(path)
    prompts = [tokenizer.encode_prompt(text) for text in TEXTS]
    assert prompts == [folder_tokenizer.encode_prompt(text) for text in TEXTS]
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)
    engine = OfflineEngine(model, tokenizer, n_slots=4)
    outputs = engine.generate(prompts, GenerationParams(max_tokens=NEW_TOKENS, sampling=GREEDY))
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt) :].tolist()
        assert output.token_ids == [t for t in expected if t != reference.generation_config.eos_token_id][: len(output.token_ids)]
        assert len(output.token_ids) == NEW_TOKENS or expected[len(output.token_ids)] in (model.config.eos_id, *model.config.extra_eos_ids)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_quantized_matrices_stay_in_their_blocks_at_the_files_size(files: dict[tuple[str, str], Path], kind: str) -> None:
    path = files["qwen2", kind]
    model, _ = load_gguf(path)
    assert isinstance(model.embed, BlockEmbedding) and isinstance(model.output_projection, BlockLinear)
    assert model.output_projection.blocks.data_ptr() == model.embed.blocks.data_ptr()  # tied: one table
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert len(layers) == 1 + 5 * model.config.n_layers and all(layer.ggml_type == QUANTIZED[kind] for layer in layers)
    held = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.buffers(), *model.parameters()]}
    assert sum(held.values()) <= 1.1 * path.stat().st_size
    if packing_available():  # the engine packs the float layers; the blocks and the tied projection stay
        pack_linear_layers(model)
        assert isinstance(model.output_projection, BlockLinear)


def copy_of(source: Path, out: Path, architecture: str = "llama", skip: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """A reader of source and a writer of out holding source's metadata (but keys starting with one
    of `skip`) under `architecture`; the caller adds the tensors and calls write_out."""
    reader, writer = gguf.GGUFReader(source), gguf.GGUFWriter(str(out), architecture)
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture", *skip)):
            continue
        name = field.name.replace("llama.", f"{architecture}.", 1)
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    return reader, writer


def write_out(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_mixing_types_keeps_each_tensor_in_its_own(folders: dict[str, Path], tmp_path: Path) -> None:
    """A Q4_K_M-like mix: v in Q8_0 beside q and k in Q4_0 makes the qkv projection of parts."""
    path = export_gguf(folders["llama"], tmp_path / "mixed.gguf", "Q4_0")
    mixed = tmp_path / "mixed-v.gguf"
    reader, writer = copy_of(path, mixed)
    reference, _ = load_gguf(path)
    for tensor in reader.tensors:
        if tensor.name.endswith("attn_v.weight"):
            weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(
                tensor.name, gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    write_out(writer)
    model, _ = load_gguf(mixed)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ConcatenatedLinear) and [p.ggml_type for p in qkv.parts] == [
        block_quant.Q4_0,
        block_quant.Q4_0,
        block_quant.Q8_0,
    ]
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        assert (model(ids) - reference(ids)).abs().max() < 0.5  # only v's rounding differs
        torch.testing.assert_close(model(ids), transformers_model(mixed)(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ggml_type", [block_quant.Q8_0, block_quant.Q4_0, block_quant.Q4_1])
def test_block_kernels_compute_what_the_gguf_dequantizer_says(ggml_type: int) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96) * torch.rand(200, 1), torch.randn(200)
    blocks = block_quant.quantize(weight, ggml_type)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type)).astype(np.float32))
    assert torch.equal(dequantize(blocks, ggml_type, 96), reference)
    assert torch.equal(dequantize_rows(blocks, ggml_type, 96), reference)
    ids = torch.tensor([5, 0, 199, 5])
    assert torch.equal(dequantize_rows(blocks, ggml_type, 96, ids), reference[ids])
    with pytest.raises(IndexError):
        dequantize_rows(blocks, ggml_type, 96, torch.tensor([200]))
    if block_quant._kernels() is None:
        pytest.skip("the C kernels are off here")
    for rows in [1, 2, 3, 7, 8, 9, 16, 17, 40]:  # every row group's size, and the slabs past KERNEL_ROWS
        x = torch.randn(rows, 96)
        torch.testing.assert_close(block_product(x, blocks, bias, 200, ggml_type), x @ reference.T + bias, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(block_product(x, blocks, None, 200, ggml_type), x @ reference.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ggml_type", [block_quant.Q8_0, block_quant.Q4_0, block_quant.Q4_1])
def test_interleaved_blocks_hold_the_files_bytes_and_compute_what_they_do(ggml_type: int) -> None:
    """The 8-row interleaved layout: the same bytes (interleave's inverse gives the file's back), the
    same weights dequantized, and products equal to the file layout's up to float32 summing order,
    each row's output independent of the others in its call."""
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96) * torch.rand(200, 1), torch.randn(200)
    blocks = block_quant.quantize(weight, ggml_type)
    interleaved, ours = block_quant.interleave(blocks, ggml_type), block_quant.INTERLEAVED[ggml_type]
    assert interleaved.shape == blocks.shape and not torch.equal(interleaved, blocks)
    assert torch.equal(block_quant.deinterleave(interleaved, ours), blocks)
    reference = dequantize(blocks, ggml_type, 96)
    assert torch.equal(dequantize(interleaved, ours, 96), reference)
    assert torch.equal(dequantize_rows(interleaved, ours, 96), reference)  # the C kernel where built
    ids = torch.tensor([5, 0, 199, 5, 8])
    assert torch.equal(dequantize_rows(interleaved, ours, 96, ids), reference[ids])
    with pytest.raises(ValueError, match="in groups of 8"):
        block_product(torch.randn(1, 96), interleaved[:196], None, 196, ours, 8)
    if not block_quant.interleaved_available():
        pytest.skip("no interleaved kernels on this CPU (AVX2 or AVX-512 VNNI)")
    for rows in [1, 2, 3, 7, 8, 9, 16, 17]:
        x = torch.randn(rows, 96)
        got = block_product(x, interleaved, bias, 200, ours, 8)
        torch.testing.assert_close(got, block_product(x, blocks, bias, 200, ggml_type, 8), atol=1e-5, rtol=1e-5)
        for i in range(rows):
            assert torch.equal(block_product(x[i : i + 1], interleaved, bias, 200, ours, 8)[0], got[i])
        torch.testing.assert_close(block_product(x, interleaved, bias, 200, ours, 32), x @ reference.T + bias, atol=1e-4, rtol=1e-4)


def _mapping_rss_kb(address: int) -> int:
    """The resident kB of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split()[0]:
            low, high = (int(a, 16) for a in line.split()[0].split("-"))
            inside = low <= address < high
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc and madvise: Linux")
def test_a_files_pages_leave_the_resident_set_once_laid_out_anew_and_read_back_the_same(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    (tmp_path / "tensor.bin").write_bytes(data.tobytes())
    mapped = torch.from_numpy(np.memmap(tmp_path / "tensor.bin", dtype=np.uint8, mode="c"))  # as GGUFReader(path, "c") maps
    assert int(mapped.sum()) == int(data.sum()) and _mapping_rss_kb(mapped.data_ptr()) >= 1024  # read: resident
    assert block_quant.release_file_pages(mapped)
    assert _mapping_rss_kb(mapped.data_ptr()) == 0
    assert torch.equal(mapped, torch.from_numpy(data))  # read again: from the file
    anonymous = torch.arange(1 << 18, dtype=torch.int32)
    assert not block_quant.release_file_pages(anonymous) and torch.equal(anonymous, torch.arange(1 << 18, dtype=torch.int32))


def test_block_linear_without_the_kernel_multiplies_the_dequantized_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = BlockLinear.quantized(torch.randn(64, 64), torch.randn(64), block_quant.Q4_1)
    x = torch.randn(2, 3, 64)
    with_kernel = layer(x)
    monkeypatch.setattr(block_quant, "_kernel_applies", lambda *_: False)
    plain = F.linear(x, dequantize(layer.blocks, block_quant.Q4_1, 64), layer.bias)
    torch.testing.assert_close(layer(x), plain)
    torch.testing.assert_close(with_kernel, plain, atol=1e-4, rtol=1e-4)


def test_block_product_checks_its_arguments() -> None:
    blocks = block_quant.quantize(torch.randn(32, 64), block_quant.Q8_0)
    with pytest.raises(ValueError, match="bytes a row"):
        block_product(torch.randn(1, 96), blocks, None, 32, block_quant.Q8_0)
    with pytest.raises(ValueError, match="contiguous uint8 of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"):
        block_product(torch.randn(1, 64), blocks, None, 32, 10)  # Q2_K
    with pytest.raises(ValueError, match="bias"):
        block_product(torch.randn(1, 64), blocks, torch.zeros(31), 32, block_quant.Q8_0)
    assert BLOCK_BYTES[block_quant.Q8_0] * 2 == blocks.shape[1]


@pytest.mark.parametrize(
    "ggml_type", [block_quant.Q8_0, block_quant.Q4_0, block_quant.Q4_1, *sorted(block_quant.K_QUANTS), *sorted(block_quant.FILE_TYPE)]
)
def test_the_cpp_block_operator_equals_its_python_function(ggml_type: int) -> None:
    if "block_linear" not in cpu_kernels.native_operators():
        pytest.skip("the C++ operators did not build here")
    torch.manual_seed(0)
    if ggml_type in block_quant.K_QUANTS:
        blocks = random_k_blocks(ggml_type, 200, 512, ggml_type)
    elif ggml_type in block_quant.FILE_TYPE:
        file_type = block_quant.FILE_TYPE[ggml_type]
        blocks = block_quant.interleave(block_quant.quantize(torch.randn(200, 512) * torch.rand(200, 1), file_type), file_type)
    else:
        blocks = block_quant.quantize(torch.randn(200, 512) * torch.rand(200, 1), ggml_type)
    operator = torch.ops.transformer_serving.block_linear
    cases = [(1, True, 8, 8), (3, False, 32, 8), (8, True, 32, 8), (9, True, 32, 8), (9, False, 8, 8), (17, True, 32, 32)]
    for rows, bias, bits, kernel_rows in cases:  # (rows, bias, activation bits, kernel rows): the kernel, 8 bits, the slabs
        x = torch.randn(rows, 1024)[:, ::2]  # not contiguous: both copy it
        b = torch.randn(200) if bias else None
        got = operator(x, blocks, b, 200, ggml_type, bits, kernel_rows)
        assert torch.equal(got, block_product(x, blocks, b, 200, ggml_type, bits, kernel_rows)), (rows, bias, bits)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, w, b, t: (x.double(), w, b, 32, t), "rows"),
        (lambda x, w, b, t: (x[:, :48], w, b, 32, t), "not a multiple of its block"),
        (lambda x, w, b, t: (x[:, :96], w, b, 32, t), "bytes a row"),
        (lambda x, w, b, t: (x, w, b, 32, 10), "a type the kernels do not read"),  # Q2_K
        (lambda x, w, b, t: (x, w[:, :-1].contiguous(), b, 32, t), "bytes a row"),
        (lambda x, w, b, t: (x, w[:16], b, 32, t), "blocks"),
        (lambda x, w, b, t: (x, w.view(torch.int8), b, 32, t), "uint8"),
        (lambda x, w, b, t: (x, w, b[:31], 32, t), "bias"),
        (lambda x, w, b, t: (x, w, b.double(), 32, t), "bias"),
    ],
)
def test_the_cpp_block_operator_refuses_shapes_and_dtypes_not_its_own(change: Any, message: str) -> None:
    if "block_linear" not in cpu_kernels.native_operators():
        pytest.skip("the C++ operators did not build here")
    blocks = block_quant.quantize(torch.randn(32, 128), block_quant.Q8_0)
    arguments = (torch.randn(2, 128), blocks, torch.zeros(32), block_quant.Q8_0)
    torch.ops.transformer_serving.block_linear(*arguments[:3], 32, arguments[3])  # as given, they are the kernel's
    with pytest.raises(ValueError, match=message):
        torch.ops.transformer_serving.block_linear(*change(*arguments))


def test_the_gguf_tokenizer_gives_the_folders_ids_and_pieces(files: dict[tuple[str, str], Path], folders: dict[str, Path]) -> None:
    for name in folders:
        _, ours = load_gguf(files[name, "Q8_0"])
        _, theirs = load_hf_folder(folders[name])
        texts = [*TEXTS, *shakespeare_lines()[:200]]
        assert [ours.encode(t) for t in texts] == [theirs.encode(t) for t in texts]
        assert [ours.encode_prompt(t) for t in texts[:3]] == [theirs.encode_prompt(t) for t in texts[:3]]
        ids = ours.encode(TEXTS[2])
        assert b"".join(ours.piece_bytes(i) for i in ids) == b"".join(theirs.piece_bytes(i) for i in ids)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.chat_template == theirs.chat_template and ours.special_ids == theirs.special_ids


def test_a_gguf_file_is_a_model_source_for_the_service(files: dict[tuple[str, str], Path]) -> None:
    path = files["llama", "Q4_1"]
    entry = ModelServingConfig(name="tiny", checkpoint=path)
    assert entry.kind == "generator" and inspect_folder(path).gguf
    model, _ = load_checkpoint(path)
    assert isinstance(model, Generator) and any(isinstance(m, BlockLinear) for m in model.modules())


def _one_line(path: Path) -> str:
    with pytest.raises(CheckpointError) as error:
        inspect_folder(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    return message


def _rewritten(
    source: Path, out: Path, drop: frozenset[str] = frozenset(), architecture: str = "llama", extra_tensor: tuple[str, int] | None = None
) -> Path:
    """source written again without the keys `drop`, under `architecture`, with an extra tensor of a type."""
    reader, writer = copy_of(source, out, architecture, tuple(drop))
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    if extra_tensor is not None:
        name, ggml_type = extra_tensor
        size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        writer.add_tensor(name, np.zeros((4, 256 // size * block_bytes), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    write_out(writer)
    return out


def test_files_the_service_cannot_serve_are_refused_with_one_line_naming_the_problem(
    files: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    good = files["llama", "Q8_0"]
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    assert "not a readable GGUF file" in _one_line(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    assert "not a readable GGUF file" in _one_line(header_only)
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGML" + data[4:])
    assert "not a readable GGUF file" in _one_line(magic)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(struct.pack("<I", 0x46554747))
    assert "not a readable GGUF file" in _one_line(empty)
    assert "missing" in _one_line(tmp_path / "absent.gguf")
    q2_k = _rewritten(good, tmp_path / "q2k.gguf", extra_tensor=("blk.0.extra.weight", gguf.GGMLQuantizationType.Q2_K))
    assert "blk.0.extra.weight has type Q2_K" in _one_line(q2_k)
    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model"]:
        assert key in _one_line(_rewritten(good, tmp_path / "no-key.gguf", drop=frozenset({key})))
    assert "architecture 'gpt2'" in _one_line(_rewritten(good, tmp_path / "gpt2.gguf", architecture="gpt2"))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelServingConfig(name="broken", checkpoint=truncated)
    unsized = _rewritten(good, tmp_path / "unsized.gguf", drop=frozenset({"llama.feed_forward_length"}))
    assert "feed_forward_length" in _one_line(unsized)


def test_a_llama_3_1_files_rope_freqs_give_its_folders_transformers_logits(tmp_path: Path) -> None:
    """Llama 3.1's RoPE scaling, which llama.cpp's converter writes as a rope_freqs tensor (each
    frequency's divisor): the file's logits are transformers' on the folder (whose GGUF loader
    ignores the tensor), past the original context, and without the tensor they are not."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 64
    folder = build_llama_folder(tmp_path / "llama3", rope_scaling=scaling, max_positions=256)
    path = export_gguf(folder, tmp_path / "llama3-F32.gguf", "F32")
    model, tokenizer = load_gguf(path)
    assert len(model.config.rope_freq_factors) == model.config.head_dim // 2 and max(model.config.rope_freq_factors) == 8.0
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(3, 800, (1, 160), generator=torch.Generator().manual_seed(0))  # past the original 64 positions
    reader, writer = copy_of(path, tmp_path / "unscaled.gguf")
    for tensor in reader.tensors:
        if tensor.name != "rope_freqs.weight":
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    write_out(writer)
    unscaled, _ = load_gguf(tmp_path / "unscaled.gguf")
    with torch.no_grad():
        logits = model(ids)
        torch.testing.assert_close(logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
        assert (unscaled(ids) - logits).abs().max() > 1.0
    engine = OfflineEngine(model, tokenizer, n_slots=2)
    [output] = engine.generate([ids[0].tolist()], GenerationParams(max_tokens=NEW_TOKENS, sampling=GREEDY))
    expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
    assert output.token_ids == [t for t in expected if t != reference.generation_config.eos_token_id][: len(output.token_ids)]
    assert len(output.token_ids) == NEW_TOKENS or expected[len(output.token_ids)] == model.config.eos_id
    pairs = model.config.head_dim // 2
    bad = [np.ones(pairs - 1, dtype=np.float32), np.zeros(pairs, dtype=np.float32), np.ones(pairs, dtype=np.float16)]
    for factors in bad:
        reader, writer = copy_of(path, tmp_path / "bad.gguf")
        for tensor in reader.tensors:
            data = factors if tensor.name == "rope_freqs.weight" else np.array(tensor.data)
            writer.add_tensor(tensor.name, data, raw_dtype=None if tensor.name == "rope_freqs.weight" else tensor.tensor_type)
        write_out(writer)
        problem = "is not F32" if factors.dtype == np.float16 else f"expected {pairs} positive factors"
        assert problem in _one_line(tmp_path / "bad.gguf")


def llama_cpp_product(rows: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """rows (N, in) times the weight in blocks (out, row bytes), as llama.cpp computes it: the rows
    quantized as Q8_0 (the gguf package's quantizer), a Q4_1 weight's min term with Q8_1's s (each
    block's sum of ints times its float32 scale, kept in fp16) where the Q8_0 rows give fp16 scale x sum."""
    n, in_features = rows.shape
    q8_rows = torch.from_numpy(
        gguf.quants.dequantize(gguf.quants.quantize(rows.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    )
    product = q8_rows @ dequantize(blocks, ggml_type, in_features).T  # (N, out)
    if ggml_type != block_quant.Q4_1:
        return product
    nb = in_features // 32
    scale = rows.view(n, nb, 32).abs().amax(-1) / 127  # (N, blocks), float32
    stored = scale.half().float()
    sums = (q8_rows.view(n, nb, 32) / torch.where(stored > 0, stored, 1)[..., None]).round().sum(-1)  # (N, blocks): the ints' sums
    mins = blocks.view(-1, nb, 20)[:, :, 2:4].contiguous().view(torch.float16).float()[..., 0]  # (out, blocks)
    return product + ((scale * sums).half().float() - stored * sums) @ mins.T


@pytest.mark.parametrize("ggml_type", [block_quant.Q8_0, block_quant.Q4_0, block_quant.Q4_1])
def test_8_bit_activations_are_float_activations_rounded_and_batch_independent(ggml_type: int) -> None:
    if not block_quant.q8_available():
        pytest.skip("no 8-bit activation kernels on this CPU")
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    blocks = block_quant.quantize(weight, ggml_type)
    rows = torch.randn(7, 96)
    rows[2] *= 100  # a row far larger than the rest: its own scales
    exact = block_product(rows, blocks, bias, 200, ggml_type, 32)
    rounded = block_product(rows, blocks, bias, 200, ggml_type, 8)
    assert 0 < ((rounded - exact).norm() / exact.norm()) < 0.02
    for i in range(7):
        assert torch.equal(block_product(rows[i : i + 1], blocks, bias, 200, ggml_type, 8)[0], rounded[i])
    torch.testing.assert_close(rounded, llama_cpp_product(rows, blocks, ggml_type) + bias, atol=1e-3, rtol=1e-4)


def test_activation_bits_are_set_on_every_block_layer(files: dict[tuple[str, str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_gguf(files["qwen2", "Q4_1"])
    file_bytes = {name: b.clone() for name, b in model.named_buffers() if name.endswith("blocks")}
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        logits = model(ids)
    assert block_quant.set_activation_bits(model, 8) == 1 + 5 * model.config.n_layers
    assert {m.activation_bits for m in model.modules() if isinstance(m, BlockLinear)} == {8}
    assert isinstance(model.output_projection, BlockLinear) and isinstance(model.embed, BlockEmbedding)
    assert model.output_projection.blocks.data_ptr() == model.embed.blocks.data_ptr()  # tied: still one table
    layouts = {m.ggml_type for m in model.modules() if isinstance(m, BlockLinear | BlockEmbedding)}
    assert layouts == ({block_quant.Q4_1_X8} if block_quant.interleaved_available() else {block_quant.Q4_1})
    as_in_the_file, _ = load_gguf(files["qwen2", "Q4_1"])
    monkeypatch.setattr(block_quant, "interleaved_available", lambda: False)
    block_quant.set_activation_bits(as_in_the_file, 8)
    assert {m.ggml_type for m in as_in_the_file.modules() if isinstance(m, BlockLinear)} == {block_quant.Q4_1}
    monkeypatch.undo()
    with torch.no_grad():  # the layouts' products differ only in float32 summing order
        torch.testing.assert_close(model(ids), as_in_the_file(ids), atol=1e-4, rtol=1e-4)
        assert torch.equal(model.embed(ids), as_in_the_file.embed(ids))
    assert block_quant.set_activation_bits(model, 32) == 1 + 5 * model.config.n_layers
    assert {name: b for name, b in model.named_buffers() if name.endswith("blocks")}.keys() == file_bytes.keys()
    assert all(torch.equal(b, file_bytes[name]) for name, b in model.named_buffers() if name.endswith("blocks"))
    with torch.no_grad():
        assert torch.equal(model(ids), logits)
    with pytest.raises(ValueError, match="8 or 32"):
        block_quant.set_activation_bits(model, 16)


K_QUANTS = [block_quant.Q4_K, block_quant.Q5_K, block_quant.Q6_K]


def random_k_blocks(ggml_type: int, rows: int, in_features: int, seed: int) -> Tensor:
    """Rows of random k-quant super-blocks with small, finite fp16 scales (d, and dmin where the type has one)."""
    generator = np.random.default_rng(seed)
    size = BLOCK_BYTES[ggml_type]
    blocks = generator.integers(0, 256, (rows, in_features // 256, size), dtype=np.uint8)
    scales = generator.uniform(0.0005, 0.004, (rows, in_features // 256, 2)).astype(np.float16).view(np.uint8)
    if ggml_type == block_quant.Q6_K:
        blocks[..., 208:210] = scales[..., :2]  # d last
    else:
        blocks[..., 0:4] = scales  # d, dmin first
    return torch.from_numpy(blocks.reshape(rows, -1).copy())


@pytest.mark.parametrize("ggml_type", K_QUANTS)
def test_k_quant_kernels_compute_what_the_gguf_dequantizer_says(ggml_type: int) -> None:
    blocks = random_k_blocks(ggml_type, 40, 512, ggml_type)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type)).astype(np.float32))
    assert torch.equal(dequantize(blocks, ggml_type, 512), reference)
    torch.testing.assert_close(dequantize_rows(blocks, ggml_type, 512), reference, atol=1e-6, rtol=1e-6)
    if block_quant._kernels() is None:
        pytest.skip("the C kernels are off here")
    bias = torch.randn(40)
    for rows in [1, 2, 3, 8, 9, 17]:
        x = torch.randn(rows, 512)
        for bits in (32, 8):  # 8-bit activations are for the 32-weight types: the k-quants keep float32
            got = block_product(x, blocks, bias, 40, ggml_type, bits)
            torch.testing.assert_close(got, x @ reference.T + bias, atol=1e-4, rtol=1e-4)


def test_a_k_quant_file_gives_transformers_logits(tmp_path: Path) -> None:
    """A Q4_K_M-like file: Q6_K embedding and v, Q4_K q/k/gate/up, Q5_K the rest (random blocks in
    place of the exported weights): our logits are those transformers computes from the same file."""
    folder = build_llama_folder(tmp_path / "wide", hidden_size=256, intermediate_size=512, tie=True)
    source = export_gguf(folder, tmp_path / "f32.gguf", "F32")
    path = tmp_path / "k.gguf"
    reader, writer = copy_of(source, path)
    for i, tensor in enumerate(reader.tensors):
        rows, columns = (int(n) for n in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
        if not rows:
            writer.add_tensor(tensor.name, np.array(tensor.data))
            continue
        name = tensor.name
        kind = (
            block_quant.Q6_K
            if "token_embd" in name or "attn_v" in name
            else block_quant.Q4_K
            if any(part in name for part in ("attn_q", "attn_k", "ffn_gate", "ffn_up"))
            else block_quant.Q5_K
        )
        blocks = random_k_blocks(kind, rows, columns, i).numpy()
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType(kind))
    write_out(writer)
    model, _ = load_gguf(path)
    kinds = {m.ggml_type for m in model.modules() if isinstance(m, BlockLinear)}
    assert kinds == set(K_QUANTS) and isinstance(model.embed, BlockEmbedding)
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(ours, transformers_model(path)(ids).logits, atol=1e-3, rtol=1e-4)
    assert ours.std() > 0.01  # the blocks matter: not a model of zeros


def test_a_sentencepiece_vocabulary_gives_transformers_and_sentencepieces_ids(files: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """tokenizer.ggml.model "llama" (Llama 2, TinyLlama, Mistral files): pieces and scores of a
    SentencePiece BPE model, merges derived from the scores, bytes by fallback pieces."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(shakespeare_lines()[:4000]),
        model_writer=proto,
        vocab_size=832,  # the folder's rows
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    reader, writer = copy_of(files["llama", "F32"], path, skip=("tokenizer.",))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    write_out(writer)
    _, ours = load_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*TEXTS, *shakespeare_lines()[4000:4200]]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert ours.encode_prompt(text) == [sp.bos_id(), *ids]
        assert ours.decode(ids) == sp.decode(ids)
    # Runs of spaces: llama.cpp's tokenizer (llama-cpp-python 0.3.36 gave ours on these 304 texts, a run not
    # kept) and ours keep each as a word mark, where sentencepiece's trainer
    # collapsed them and transformers' converter drops the first: the text comes back whole.
    text = "  two  spaces, a tab\tand ÜNÏCÖDÉ ½ €5"
    ids = ours.encode(text)
    assert b"".join(ours.piece_bytes(i) for i in ids) == (" " + text).encode() and ours.decode(ids) == text


def _vector_targets() -> list[str]:
    """gcc -march targets this CPU runs: SSE (the portable lanes), AVX2, AVX-512 where it has them."""
    if platform.machine() != "x86_64":
        return []
    flags = set(Path("/proc/cpuinfo").read_text().split())
    return ["x86-64"] + ["x86-64-v3"] * ("avx2" in flags and "fma" in flags) + ["x86-64-v4"] * ("avx512f" in flags)


@pytest.mark.parametrize("target", _vector_targets())
def test_the_block_kernels_built_for_each_vector_width_compute_the_reference(target: str, tmp_path: Path) -> None:
    """block_linear (every type, every row group), block_rows, and where the build has them
    (AVX2 and up) block_linear_q8 and int8_linear, built for each width this CPU runs, not only its
    widest, against the gguf package's dequantizer and torch's products."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = ctypes.CDLL(str(cpu_kernels.build(compiler, tmp_path, march=target)))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    linear, rows_of, available = library.block_linear, library.block_rows, library.block_linear_q8_available
    linear.restype, linear.argtypes = ctypes.c_int, [pointer] * 4 + [size] * 4
    rows_of.restype, rows_of.argtypes = ctypes.c_int, [pointer, pointer, size, size, size, pointer]
    available.restype, available.argtypes = ctypes.c_int, []
    torch.manual_seed(0)
    in_features, out_features = 256, 37
    for ggml_type in [block_quant.Q8_0, block_quant.Q4_0, block_quant.Q4_1, *K_QUANTS]:
        if ggml_type in K_QUANTS:
            blocks = random_k_blocks(ggml_type, out_features, in_features, ggml_type)
        else:
            blocks = block_quant.quantize(torch.randn(out_features, in_features), ggml_type)
        reference = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type)).astype(np.float32))
        dense = torch.empty(out_features, in_features)
        assert rows_of(blocks.data_ptr(), None, out_features, in_features, ggml_type, dense.data_ptr()) == 0
        torch.testing.assert_close(dense, reference, atol=1e-6, rtol=1e-6)
        bias = torch.randn(out_features)
        for rows in [1, 2, 3, 5, 8, 9, 13]:
            x, y = torch.randn(rows, in_features), torch.empty(rows, out_features)
            assert linear(x.data_ptr(), blocks.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, in_features, out_features, ggml_type) == 0
            torch.testing.assert_close(y, x @ reference.T + bias, atol=1e-4, rtol=1e-4)
    if not available():
        assert target == "x86-64"  # the 8-bit kernels need AVX2
        return
    quantize_rows, linear_q8, int8 = library.quantize_rows_q8, library.block_linear_q8, library.int8_linear
    quantize_rows.restype, quantize_rows.argtypes = None, [pointer, size, size, pointer, pointer, pointer, size]
    linear_q8.restype, linear_q8.argtypes = ctypes.c_int, [pointer] * 6 + [size] * 4
    int8.restype, int8.argtypes = ctypes.c_int, [pointer] * 5 + [size] * 3
    for rows in [1, 2, 3, 4, 5, 9]:
        x = torch.randn(rows, in_features)
        for ggml_type in [block_quant.Q8_0, block_quant.Q4_0, block_quant.Q4_1]:
            quantized, scales = torch.empty(rows, in_features, dtype=torch.int8), torch.empty(2, rows, in_features // 32)
            quantize_rows(x.data_ptr(), rows, in_features, quantized.data_ptr(), scales[0].data_ptr(), scales[1].data_ptr(), ggml_type)
            blocks = block_quant.quantize(torch.randn(out_features, in_features), ggml_type)
            y = torch.empty(rows, out_features)
            args = (quantized.data_ptr(), scales[0].data_ptr(), scales[1].data_ptr(), blocks.data_ptr(), None, y.data_ptr())
            assert linear_q8(*args, rows, in_features, out_features, ggml_type) == 0
            torch.testing.assert_close(y, llama_cpp_product(x, blocks, ggml_type), atol=1e-3, rtol=1e-4)
        layer = Int8Linear.from_linear(torch.nn.Linear(in_features, out_features))
        row_scale = x.abs().amax(dim=-1, keepdim=True) / 127
        xq = torch.round(x / row_scale).to(torch.int8)
        y = torch.empty(rows, out_features)
        bias = layer.bias
        assert bias is not None and layer.weight_x8 is not None
        args = (x.data_ptr(), layer.weight_x8.data_ptr(), layer.scale.data_ptr(), bias.data_ptr(), y.data_ptr())
        assert int8(*args, rows, in_features, out_features) == 0
        assert torch.equal(y, (xq.float() @ layer.weight_t.float()) * (row_scale * layer.scale) + bias)
