"""Decode steps with fixed shapes by bucket, captured as CUDA graphs on the GPU (as vLLM does).

A step of shape (B, L) runs rows [0, B) and attends over keys [0, L): B is the smallest batch
bucket (1, 2, 4, ... and n_slots) that holds the highest running slot, L the smallest key-length
bucket (64, 128, ... and the context) past the furthest position; the translator's step also
reads source keys [0, S) for the smallest source bucket S past its longest source. The scheduler
hands out the lowest free slots, so the highest slot is near the number of running sequences.
Both models' self-attention keys are paged: a step reads them through block tables that are
inputs of the step (of the captured graph), as vLLM's; the translator's source keys are read as
views of its per-slot cross-attention cache. Rows [0, B) not running this step are idle: they
feed the model's pad at position 0 into the null block and their logits are dropped.

On CUDA each shape's graph is captured the first time a step needs it (lazily: at most the
buckets the traffic reaches, len(batch buckets) x len(key buckets) [x len(source buckets)]), all
in one memory pool. On the CPU the same fixed-shape step runs eagerly (to test it against the
dynamic step). The steps return logits; the runner suppresses ids and samples.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from model.generator import Generator
from model.kv_cache import CrossAttentionCache, PagedKVCache, PagedLayer, RaggedStep, cache_slots, decode_group
from model.translator import Translator

SMALLEST_KEY_BUCKET = 64  # below it, a step's attention costs too little to be worth a graph of its own
WARM_UP_STEPS = 2  # before a capture: the allocator and the kernels' lazy set-up run outside the graph

PagedFed = dict[int, tuple[int, int, list[int]]]  # slot -> (token, position, block table) of every sequence running a step


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """The sizes captured up to limit: powers of two from smallest while below limit, then limit."""
    sizes = []
    size = smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def bucket(size: int, sizes: Sequence[int]) -> int:
    """The smallest of sizes (ascending) that is at least size."""
    for s in sizes:
        if s >= size:
            return s
    raise ValueError(f"{size} is beyond the largest bucket {sizes[-1]}")


class StepShape(NamedTuple):
    batch: int  # cache rows [0, batch)
    length: int  # self-attention keys [0, length)
    source: int  # cross-attention keys [0, source); 0 for a decoder-only model


class BucketedDecoder:
    """Static inputs for every row (ids, positions, block tables) and, per step shape, the step (on
    CUDA its graph). Subclasses say what one step of a shape computes (`_step`), over `_paged`."""

    def __init__(self, cache: PagedKVCache, n_slots: int, max_len: int, pad_id: int, capture: bool, source_length: int = 0) -> None:
        """n_slots rows of up to max_len tokens; source_length: the cross-attention cache's length (0: none)."""
        device = cache.keys[0].device
        self.cache, self.max_len, self.pad_id, self.capture = cache, max_len, pad_id, capture
        self.inputs = torch.zeros(2, n_slots, 1, dtype=torch.long, device=device)  # static: ids and positions
        self.ids, self.positions = self.inputs[0], self.inputs[1]  # (N, 1) each
        self.tables = torch.zeros(n_slots, -(-max_len // cache.block_size), dtype=torch.long, device=device)  # static: null blocks
        self.batch_sizes = buckets(n_slots)
        self.key_lengths = buckets(max_len, SMALLEST_KEY_BUCKET)
        self.source_lengths = buckets(source_length, SMALLEST_KEY_BUCKET) if source_length else [0]
        self.graphs: dict[StepShape, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def shape_for(self, fed: PagedFed, source_length: int = 0) -> StepShape:
        """The smallest bucketed shape that runs every slot of fed at its position."""
        furthest = max(position for _, position, _ in fed.values())
        assert furthest < self.max_len, "position beyond the cache"
        return StepShape(
            bucket(max(fed) + 1, self.batch_sizes), bucket(furthest + 1, self.key_lengths), bucket(source_length, self.source_lengths)
        )

    def _step(self, shape: StepShape) -> Callable[[], Tensor]:
        """The step of this shape over the static inputs' rows [0, shape.batch): logits (B, V)."""
        raise NotImplementedError

    def _paged(self, shape: StepShape, slopes: Tensor | None) -> Callable[[], list[PagedLayer]]:
        """The paged self-attention of rows [0, B) over whole blocks past key bucket L: each row its
        keys [0, its position]; built from the static inputs when the step runs (inside a graph)."""
        B, nb = shape.batch, -(-shape.length // self.cache.block_size)
        positions, tables = self.positions[:B, 0], self.tables[:B, :nb]  # (B,), (B, nb)
        rows = torch.arange(B, device=positions.device)

        def layers() -> list[PagedLayer]:
            group = decode_group(rows, tables, positions + 1, self.cache.block_size, slopes)
            return self.cache.layers(RaggedStep(cache_slots(self.tables[:B], positions, self.cache.block_size), group, []))

        return layers

    @torch.no_grad()
    def __call__(self, fed: PagedFed, source_length: int = 0) -> Tensor:
        """Logits (R, V) of the next token for the sequences of fed (slot -> (token, position,
        block table)), in its order; source_length: the longest source among them (translator)."""
        shape = self.shape_for(fed, source_length)
        host = torch.zeros(2, shape.batch, 1, dtype=torch.long)  # (2, B, 1): ids, positions (idle rows: pad at 0)
        tables = torch.zeros(shape.batch, self.tables.shape[1], dtype=torch.long)  # (B, nb): idle rows the null block
        host[0] = self.pad_id
        for slot, (token, position, table) in fed.items():
            host[0, slot, 0], host[1, slot, 0] = token, position
            tables[slot, : len(table)] = torch.tensor(table)
        self.inputs[:, : shape.batch].copy_(host)  # host-to-device copies
        self.tables[: shape.batch].copy_(tables)
        logits = self._replay(shape) if self.capture else self._step(shape)()
        return logits.index_select(0, torch.tensor(list(fed), device=logits.device))

    def _replay(self, shape: StepShape) -> Tensor:
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(self._step(shape))
        graph, logits = self.graphs[shape]
        graph.replay()
        return logits

    def _capture(self, step: Callable[[], Tensor]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The step's graph and its output. Warm-up runs really run: on the inputs of the step
        about to replay, so they write what it writes."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_STEPS):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        return graph, logits


class GeneratorDecoder(BucketedDecoder):
    """The generator's decode step by bucket over its paged cache."""

    def __init__(self, model: Generator, cache: PagedKVCache, n_slots: int, max_len: int, capture: bool) -> None:
        super().__init__(cache, n_slots, max_len, model.config.pad_id, capture)
        self.model = model

    def _step(self, shape: StepShape) -> Callable[[], Tensor]:
        ids, positions = self.ids[: shape.batch, 0], self.positions[: shape.batch, 0]  # (B,) each
        layers = self._paged(shape, self.model.positions.alibi_slopes)
        rows = torch.arange(shape.batch, device=ids.device)

        def step() -> Tensor:
            return self.model.forward_ragged(ids, positions, layers(), rows)  # (B, V)

        return step


class TranslatorDecoder(BucketedDecoder):
    """The translator's decoder step by bucket: paged self-attention, cross-attention over each
    row's own copy of its source's keys (memory_group 1: a beam row reads its copy)."""

    def __init__(self, model: Translator, cache: PagedKVCache, cross_cache: CrossAttentionCache, capture: bool) -> None:
        super().__init__(cache, cross_cache.n_slots, cross_cache.length, model.config.pad_id, capture, cross_cache.length)
        self.model, self.cross_cache = model, cross_cache

    def _step(self, shape: StepShape) -> Callable[[], Tensor]:
        ids, positions = self.ids[: shape.batch], self.positions[: shape.batch]  # (B, 1) each
        layers = self._paged(shape, self.model.positions.alibi_slopes)
        memory_kv, src_mask = self.cross_cache.read(range(shape.batch), shape.source)  # (B, H, S, D) per layer, (B, 1, 1, S)

        def step() -> Tensor:
            return self.model.decode(ids, memory_kv, src_mask, positions, layers())[:, -1]  # (B, V)

        return step
