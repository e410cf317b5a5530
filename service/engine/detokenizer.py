"""Incremental detokenization: token ids -> text pieces that never split a UTF-8 character,
holding back text that might still become a stop string. As vLLM's, no stop string ends in the
text of the first `min_tokens` tokens."""

import codecs
from typing import Protocol


class Pieces(Protocol):
    """What a detokenizer reads of a tokenizer (loading/tokenizer.py's TextTokenizer has it)."""

    def piece_bytes(self, token_id: int) -> bytes: ...


class PieceBytes:
    """A tokenizer's piece_bytes, each token's computed once (a tokenizer takes several calls into
    its library for one): shared by every request's detokenizer."""

    def __init__(self, tokenizer: Pieces) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def piece_bytes(self, token_id: int) -> bytes:
        piece = self._bytes.get(token_id)
        if piece is None:
            piece = self._bytes[token_id] = self.tokenizer.piece_bytes(token_id)
        return piece


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Pieces, stop: tuple[str, ...] = (), strip_leading_space: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self._hold = max((len(s) - 1 for s in stop), default=0)  # characters that may begin a stop string
        self.strip_leading_space = strip_leading_space  # sentence tokenizers mark a word start with a space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds an incomplete character back
        self.text = ""  # all complete text so far (stop string excluded once found)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False  # a stop string was found
        self._tokens = 0  # tokens added
        self._stops_end_after = 0  # characters of self.text a stop string must end beyond (min_tokens' text)

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text now safe to emit (maybe empty)."""
        piece = self._utf8.decode(self.tokenizer.piece_bytes(token_id))
        if self.strip_leading_space and not self.text:
            piece = piece.lstrip(" ")
        self.text += piece
        self._tokens += 1
        if self._tokens <= self.min_tokens:
            self._stops_end_after = len(self.text)
        else:
            for stop in self.stop:
                index = self.text.find(stop, max(0, self._emitted - len(stop), self._stops_end_after - len(stop) + 1))
                if index != -1:
                    self.text, self.stopped = self.text[:index], True
                    return self.flush()
        safe = max(self._emitted, len(self.text) - self._hold)
        out, self._emitted = self.text[self._emitted : safe], safe
        return out

    def flush(self) -> str:
        """The rest of the text, at the end of the sequence: an incomplete last character (the
        length limit fell inside it) as U+FFFD, as transformers decodes one."""
        if not self.stopped:
            self.text += self._utf8.decode(b"", final=True)
        out, self._emitted = self.text[self._emitted :], len(self.text)
        return out
