"""Attention maps for the playground and the API: a private copy of a model, used by one caller
at a time outside the step loop (model/attention_maps.py hooks the modules it reads)."""

import threading
from pathlib import Path

import torch

from loading.checkpoint import Model, load_checkpoint
from loading.tokenizer import TextTokenizer
from model.attention_maps import cross_attention, self_attention
from model.generator import Generator
from service.engine.errors import InvalidRequestError


class AttentionInspector:
    """Loads its own float32 copy of the checkpoint on first use; thread-safe."""

    def __init__(self, checkpoint: Path, device: str = "cpu") -> None:
        self.checkpoint, self.device = checkpoint, device
        self._lock = threading.Lock()
        self._loaded: tuple[Model, TextTokenizer] | None = None

    @staticmethod
    def _tokens(model: Model, tokenizer: TextTokenizer, ids: list[int]) -> tuple[str, ...]:
        """Each token's text; the model's bos and eos as <s> and </s>."""
        special = {model.config.bos_id: "<s>", model.config.eos_id: "</s>"}
        return tuple(special.get(i) or tokenizer.piece_bytes(i).decode("utf-8", errors="replace") for i in ids)

    def attention(self, text: str, target: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...], torch.Tensor]:
        """(source tokens, target tokens, weights (layers, heads, T, S)); raises
        InvalidRequestError for input the model cannot take."""
        with self._lock:
            if self._loaded is None:
                self._loaded = load_checkpoint(self.checkpoint, self.device)
            model, tokenizer = self._loaded
            max_len = model.config.max_len
            if isinstance(model, Generator):
                ids = tokenizer.encode(text)
                if not 0 < len(ids) <= max_len:
                    raise InvalidRequestError(f"the text has {len(ids)} tokens; it needs 1 to {max_len}", "text")
                tokens = self._tokens(model, tokenizer, ids)
                return tokens, tokens, self_attention(model, ids)
            source_ids = tokenizer.encode(text) + [model.config.eos_id]
            target_ids = tokenizer.encode(target or "") + [model.config.eos_id]
            if len(source_ids) > max_len or len(target_ids) > max_len - 1:
                raise InvalidRequestError(f"source and translation must be under {max_len} tokens each", "text")
            weights = cross_attention(model, source_ids, target_ids)
            return self._tokens(model, tokenizer, source_ids), self._tokens(model, tokenizer, target_ids), weights
