"""sentencepiece tokenizers with fixed special ids: pad 0, unk 1, bos 2, eos 3."""

import io
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class TextTokenizer(Protocol):
    """What the engine needs of a tokenizer: ours (below) or a Hugging Face folder's (loading/hf_tokenizers.py)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Token ids without any special token."""

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as the model's own tokenizer reads one: with the special tokens it puts
        before a text (a Llama's bos), or none."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str:
        """Text of ids; special ids are dropped."""

    def piece_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes this token contributes when it follows other text (b"" for special ids):
        streaming joins them, so no character is ever split."""

    def token_text(self, token_id: int) -> str:
        """The token as its vocabulary writes it, special ones included ("</s>"); "" for none."""

    chat_template: str | None  # the chat template's source; None: this tokenizer renders no chat

    @property
    def tool_markers(self) -> Mapping[str, int]:
        """The markers of the chat template's tool-call format that are special tokens of the
        vocabulary, with their ids: piece_bytes gives their text (the parser reads calls from it)."""

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """A conversation (and the tools it may call) as prompt text, rendered by the chat template;
        ChatTemplateError (loading/chat_template.py) when there is none or it refuses the messages."""


class ChatTemplateError(ValueError):
    """A template that cannot render these messages (raise_exception, a syntax error), or none at all."""


class WithoutChat:
    """A tokenizer with no chat template (ours, Marian's): every chat is refused."""

    chat_template: str | None = None
    tool_markers: Mapping[str, int] = MappingProxyType({})

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> str:
        raise ChatTemplateError("this model has no chat template")


class Tokenizer(WithoutChat):
    """Text <-> token ids. Wraps a trained sentencepiece model (serialized bytes)."""

    def __init__(self, model_proto: bytes) -> None:
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        assert (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, keep_layout: bool = False) -> "Tokenizer":
        """BPE over texts. keep_layout keeps newlines and runs of spaces (for free text such as plays);
        otherwise whitespace is normalised as for sentences."""
        options: dict[str, Any] = {}
        if keep_layout:
            options = {
                "normalization_rule_name": "identity",
                "remove_extra_whitespaces": False,
                "add_dummy_prefix": False,
                "user_defined_symbols": ["\n"],
                "max_sentence_length": 1 << 16,
                "split_by_whitespace": True,
            }
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            byte_fallback=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            num_threads=2,
            minloglevel=2,
            **options,
        )
        return cls(model.getvalue())

    @classmethod
    def load(cls, path: Path) -> "Tokenizer":
        return cls(path.read_bytes())

    def save(self, path: Path) -> None:
        path.write_bytes(self.model_proto)

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        """Token ids without bos/eos."""
        return list(self.sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.sp.encode(texts)]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # our models read prompts without bos

    def decode(self, ids: list[int]) -> str:
        """Text of ids; special ids are dropped."""
        return str(self.sp.decode([i for i in ids if i > EOS_ID]))

    def token_text(self, token_id: int) -> str:
        return str(self.sp.id_to_piece(token_id)) if 0 <= token_id < self.vocab_size else ""

    def piece_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes this token contributes when it follows other text (used for streaming)."""
        piece = self.sp.id_to_piece(token_id)
        if self.sp.is_byte(token_id):
            return bytes([int(piece[3:5], 16)])  # "<0xAB>"
        if self.sp.is_control(token_id) or self.sp.is_unknown(token_id):
            return b""
        return piece.replace("\u2581", " ").encode("utf-8")
