"""The generator's decode step with fixed shapes, captured as a CUDA graph on the GPU.

Every slot takes part in every step (idle slots feed the model's pad and write to the last cache
position, which a sequence overwrites before it reads it) and every step attends over the cache's
whole length (the serving context), so one graph serves all steps. On the CPU the same
fixed-shape step runs eagerly (used to test it). The runner suppresses ids in the logits it returns.
"""

import torch
from torch import Tensor

from model.generator import Generator
from model.kv_cache import KVCache


class FixedShapeDecoder:
    def __init__(self, model: Generator, cache: KVCache, capture: bool) -> None:
        device = cache.keys[0].device
        n, self.max_len = cache.n_slots, cache.max_len
        self.model, self.cache = model, cache
        self.pad_id = model.config.pad_id
        self.ids = torch.full((n, 1), self.pad_id, dtype=torch.long, device=device)  # (N, 1) static input buffers
        self.positions = torch.full((n, 1), self.max_len - 1, dtype=torch.long, device=device)
        self.slots = torch.arange(n, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if capture:
            self._capture()

    @torch.no_grad()
    def _forward(self) -> Tensor:
        views = self.cache.views(self.slots, self.positions, self.max_len)
        return self.model(self.ids, self.positions, views, self.max_len)[:, -1]  # (N, V)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside the graph (allocator, kernels)
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.positions.fill_(self.max_len - 1)

    @torch.no_grad()
    def __call__(self, slots: list[int], tokens: list[int], positions: list[int]) -> Tensor:
        """Logits (B, V) of the next token for the sequences in `slots` fed `tokens` at `positions`."""
        assert max(positions) < self.max_len, "position beyond the cache"
        rows = torch.tensor(slots, device=self.ids.device)
        self.ids.fill_(self.pad_id)
        self.positions.fill_(self.max_len - 1)
        self.ids[rows, 0] = torch.tensor(tokens, device=self.ids.device)
        self.positions[rows, 0] = torch.tensor(positions, device=self.ids.device)
        if self.graph is not None:
            self.graph.replay()
            assert self.logits is not None
            return self.logits[rows]
        return self._forward()[rows]
