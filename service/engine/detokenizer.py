"""Incremental detokenization: token ids -> text pieces that never split a UTF-8 character,
holding back text that might still become a stop string."""

from model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), strip_leading_space: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.strip_leading_space = strip_leading_space  # sentence tokenizers mark a word start with a space
        self._pending = b""  # bytes of an incomplete UTF-8 character
        self.text = ""  # all complete text so far (stop string excluded once found)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False  # a stop string was found

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text now safe to emit (maybe empty)."""
        data = self._pending + self.tokenizer.piece_bytes(token_id)
        # Keep the tail that is an incomplete UTF-8 sequence (at most 3 bytes) for the next token.
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                piece = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = data[cut:]
            break
        else:
            piece, self._pending = data.decode("utf-8", errors="replace"), b""
        if self.strip_leading_space and not self.text:
            piece = piece.lstrip(" ")
        self.text += piece
        for stop in self.stop:
            index = self.text.find(stop, max(0, self._emitted - len(stop)))
            if index != -1:
                self.text, self.stopped = self.text[:index], True
                return self.flush()
        hold = max((len(s) - 1 for s in self.stop), default=0)
        safe = max(self._emitted, len(self.text) - hold)
        out, self._emitted = self.text[self._emitted : safe], safe
        return out

    def flush(self) -> str:
        """The rest of the text, at the end of the sequence."""
        out, self._emitted = self.text[self._emitted :], len(self.text)
        return out
