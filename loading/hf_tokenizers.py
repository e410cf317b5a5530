"""The tokenizers of Hugging Face folders, as loading.tokenizer.TextTokenizer (no transformers code runs).

- Marian (opus-mt): source.spm splits a source into pieces and vocab.json gives their ids (its own
  order, not sentencepiece's); output ids go back to pieces through vocab.json and target.spm joins
  them. The ids are MarianTokenizer's without the </s> it appends (the engine appends eos itself).
- tokenizer.json, read by the `tokenizers` library: byte-level BPE (GPT-2, Pythia, Llama 3, Qwen2) or
  sentencepiece-style pieces with byte fallback (our own export's, exports/export.py; Llama 2's).
  Prompts start with bos when transformers' tokenizer adds it (add_bos; encode_prompt), and the
  folder's chat template renders conversations (render_chat; loading/chat_template.py). A folder
  with tokenizer.model (sentencepiece) but no tokenizer.json is refused.

Like MarianTokenizer, encode reads a leading language code (">>fr<<") as one token; unlike the
transformers tokenizers, Marian's does not read "</s>", "<pad>", ... written in the text as special
tokens. A tokenizer.json's added tokens written in the text are read as those tokens, as
transformers reads them (a rendered chat template's "<|start_header_id|>", ...).
"""

import json
import re
from pathlib import Path
from typing import Any

import sentencepiece as spm
from tokenizers import Tokenizer as FastTokenizer

from loading.chat_template import ChatTemplateError, Message, compile_chat_template, render_chat_template
from loading.folder_base import CheckpointError, read_json
from loading.tokenizer import WithoutChat
from loading.tool_calls import tool_call_format
from loading.tool_formats import MARKERS

SPACE_PIECE = "\u2581"  # sentencepiece's word-start mark
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece


def _special_token(config: dict[str, Any], key: str, default: str) -> str:
    """A special token's text from tokenizer_config.json: a string, or an AddedToken as a dict."""
    value = config.get(key, default)
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _load_sentencepiece(path: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as error:
        raise CheckpointError(path, f"not a sentencepiece model ({error})") from None


def _piece_bytes(piece: str) -> bytes:
    """A sentencepiece-style piece's bytes: a byte-fallback piece's byte, else its text with the word mark as a space."""
    byte = BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPACE_PIECE, " ").encode("utf-8")


class MarianTextTokenizer(WithoutChat):
    """MarianTokenizer's ids (one vocabulary for both sides, as every opus-mt folder)."""

    def __init__(self, folder: Path) -> None:
        config = read_json(folder / "tokenizer_config.json")
        if config.get("separate_vocabs"):
            raise CheckpointError(folder / "tokenizer_config.json", "separate_vocabs is not supported")
        vocab = read_json(folder / "vocab.json")
        self.source = _load_sentencepiece(folder / "source.spm")
        self.target = _load_sentencepiece(folder / "target.spm")
        self.ids: dict[str, int] = {str(piece): int(i) for piece, i in vocab.items()}
        self.pieces = {i: piece for piece, i in self.ids.items()}
        special = [
            _special_token(config, key, default) for key, default in [("unk_token", "<unk>"), ("eos_token", "</s>"), ("pad_token", "<pad>")]
        ]
        for token in special:
            if token not in self.ids:
                raise CheckpointError(folder / "vocab.json", f"has no {token}")
        self.unk_id, self.eos_id, self.pad_id = (self.ids[token] for token in special)
        self.special_ids = {self.unk_id, self.eos_id, self.pad_id}  # MarianTokenizer's decode drops <unk> too

    @property
    def vocab_size(self) -> int:
        return len(self.ids)

    def encode(self, text: str) -> list[int]:
        """Ids of text's pieces, a leading language code (">>fr<<") as one token; no </s>."""
        code: list[str] = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        pieces = code + list(self.source.encode(text, out_type=str))
        return [self.ids.get(piece, self.unk_id) for piece in pieces]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # the translator's runner appends </s> itself

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        """Text of ids; special ids (and <unk>) are dropped."""
        pieces = [self.pieces[i] for i in ids if i in self.pieces and i not in self.special_ids]
        return str(self.target.decode_pieces(pieces)).replace(SPACE_PIECE, " ").strip()

    def token_text(self, token_id: int) -> str:
        return self.pieces.get(token_id, "")

    def piece_bytes(self, token_id: int) -> bytes:
        if token_id in self.special_ids or token_id not in self.pieces:
            return b""
        return _piece_bytes(self.pieces[token_id])


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each printable character to the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class FastTextTokenizer:
    """A tokenizer.json through the `tokenizers` library; encode gives ids without the special
    tokens a post-processor would add, encode_prompt with the bos transformers' tokenizer adds.

    tokenizer_config.json beside it (optional) names the special tokens the chat template reads,
    and may hold the template (else chat_template.jinja does)."""

    def __init__(self, path: Path) -> None:
        config_path = path.parent / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        special_tokens = {name: _special_token(config, name, "") for name in SPECIAL_TOKEN_NAMES if config.get(name)}
        template_file = path.parent / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # several named templates: transformers' default is "default"
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        spec = read_json(path)  # CheckpointError for a file that is not JSON
        self._build(
            spec,
            path.read_text(encoding="utf-8"),
            special_tokens,
            template,
            path,
            template_file if template_file.is_file() else config_path,
        )

    @classmethod
    def from_spec(cls, spec: dict[str, Any], special_tokens: dict[str, str], template: str | None, source: Path) -> "FastTextTokenizer":
        """A tokenizer.json's content that is not a file (a GGUF file's vocabulary: loading/gguf.py),
        the special tokens' texts by name (bos_token ...) and the chat template; source names it in errors."""
        tokenizer = cls.__new__(cls)
        tokenizer._build(spec, json.dumps(spec), special_tokens, template, source, source)
        return tokenizer

    def _build(
        self, spec: dict[str, Any], spec_text: str, special_tokens: dict[str, str], template: Any, source: Path, template_source: Path
    ) -> None:
        try:
            self.tokenizer = FastTokenizer.from_str(spec_text)
        except Exception as error:  # the library raises plain Exceptions
            raise CheckpointError(source, f"not a tokenizer ({error})") from None
        decoder = spec.get("decoder") or {}
        decoders = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
        self.byte_level = any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in decoders)
        self.byte_of = byte_level_alphabet()
        added = self.tokenizer.get_added_tokens_decoder()
        self.special_ids = {i for i, token in added.items() if token.special}
        self.special_tokens = special_tokens
        self.bos_id = self._bos_id()
        self.add_bos = self.bos_id is not None
        self.chat_template: str | None = template if isinstance(template, str) else None
        try:
            self._compiled = None if self.chat_template is None else compile_chat_template(self.chat_template)
        except ChatTemplateError as error:
            raise CheckpointError(template_source, str(error)) from None
        format = tool_call_format(self.chat_template or "")
        marker_ids = {marker: self.tokenizer.token_to_id(marker) for marker in (MARKERS[format] if format else ())}
        self.tool_markers: dict[str, int] = {marker: i for marker, i in marker_ids.items() if i is not None and i in self.special_ids}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the compiled template (Jinja's compiled code is not picklable): the engine's
        process sends its tokenizer to the replica (service/engine/core.py)."""
        return {**self.__dict__, "_compiled": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._compiled = None if self.chat_template is None else compile_chat_template(self.chat_template)

    def _bos_id(self) -> int | None:
        """The special token tokenizer.json's post-processor puts before the text, if any: what
        transformers 5.23 adds (tokenizer_config.json's add_bos_token does not change it)."""
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        with_specials = self.tokenizer.encode("a", add_special_tokens=True).ids
        first = with_specials[0] if len(with_specials) > len(plain) and with_specials[1:] == plain else None
        return first if first in self.special_ids else None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as transformers' tokenizer gives them: bos first when it adds one (Llama)."""
        return [self.bos_id, *self.encode(text)] if self.bos_id is not None else self.encode(text)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as prompt text, as apply_chat_template(messages, tools=tools, tokenize=False) renders
        it (bos included as text when the template writes it: encode it with encode, not encode_prompt).
        ChatTemplateError when the folder has no chat template or the template refuses the messages."""
        if self._compiled is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json chat_template, chat_template.jinja)")
        return render_chat_template(self._compiled, messages, self.special_tokens, add_generation_prompt, tools)

    def decode(self, ids: list[int]) -> str:
        """Text of ids; special ids are dropped."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    def piece_bytes(self, token_id: int) -> bytes:
        token = self.tokenizer.id_to_token(token_id)
        if token is None or (token_id in self.special_ids and token not in self.tool_markers):
            return b""
        if self.byte_level:  # each character stands for one byte (an added token's other characters for themselves)
            return b"".join(bytes([self.byte_of[c]]) if c in self.byte_of else c.encode("utf-8") for c in token)
        return _piece_bytes(token)


def fast_tokenizer_of(folder: Path) -> FastTextTokenizer:
    """A generator folder's tokenizer.json; CheckpointError for a sentencepiece tokenizer.model alone."""
    path = folder / "tokenizer.json"
    if not path.is_file() and (folder / "tokenizer.model").is_file():
        raise CheckpointError(path, "missing: a sentencepiece tokenizer.model alone is not supported (convert it to tokenizer.json)")
    return FastTextTokenizer(path)
