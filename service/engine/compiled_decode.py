"""Decode steps compiled by torch.compile (inductor), where that is faster: a decoder-only model's
decode-only steps, and a translator's decoder steps.

A decode-only step (one new token per sequence, or speculative decoding's verification: a row per
token verified, each a decode of its own whose keys the rows before it wrote in the same step)
runs the same small operations in every layer:
norms, rotary positions, the residual adds, the activation. Eagerly, each is
a dispatch and a pass over memory; inductor fuses them into a few C++ loops, and writes the new keys
and values into the pool in place. The linear layers' kernels (model/packed_linear.py) and the CPU
paged attention kernel (model/paged_attention_cpu.py) are operations the graph calls as they are,
as vLLM's compiled graphs call their attention; none writes to its inputs (an operation that did
ran through torch's functionalization, in Python, at every call: docs/performance.md). A
translator's step reads each row's source keys in place through the same kernel (its
cross-attention cache's SourceLayers), so it compiles only where that kernel runs.

Graphs: torch specializes a batch of one, so batch 1 has its own graph, and every other batch
size shares one, dynamic in the batch and in the key length (a step's key blocks are padded to at
least two, so that no length specializes either). EngineConfig.compiled_decode names the batch
sizes to try. At start the graphs are compiled and the step is timed against the eager one on the
same inputs (alternating, the median of TIMED_STEPS each) once per bucket of sizes, (2^(k-1), 2^k],
at the bucket's largest size named: every size of a bucket where compiled is faster runs compiled
(`timings` says by how much, per size timed). A 256-row translator's start times 9 sizes, not 256.
A step of another batch size runs eagerly, and so does one that would need a new graph
(torch.compiler's eager_on_recompile stance): no request waits for a compilation.

With `background`, all of that runs on a thread of its own while the engine serves eagerly, and the
compiled sizes take over when every graph is ready (`ready`). With a CompileCache, the artifacts of
an earlier start with the same key are loaded first, and a start that found none saves its own.
"""

import logging
import statistics
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from model.generator import Generator
from model.kv_cache import CrossAttentionCache, PagedKVCache, RaggedStep, cache_slots, decode_group
from model.translator import Translator
from service.engine.compile_cache import CompileCache
from service.engine.fixed_shape import bucket, buckets

logger = logging.getLogger(__name__)

WARM_UP_KEYS = 256  # key length of the timed steps (a translator's: WARM_UP_TRANSLATION_KEYS)
TIMED_STEPS = 5  # per system and batch size
MIN_KEY_BLOCKS = 2  # a step's key blocks are padded to at least this many (size 1 would specialize)
WARM_UP_SOURCE_TOKENS = 32  # a translator's timed steps: each row's source length
WARM_UP_TRANSLATION_KEYS = 64  # and its target's keys (translations are short: 256 would time attention mostly)
# The Python floats a step reads are the model's constants (a norm's eps, for one): traced as
# symbols (dynamo's default with dynamic shapes), they made dynamo trace the step twice, its second
# pass specializing them (TensorifyScalarRestartAnalysis): 44 s against 15 s a graph on a start whose
# inductor and AOT caches hold it (SmolLM2-135M's shape, batch 1, 2 cores). Steps pass no floats.
DYNAMO_CONFIG = {"specialize_float": True}


class CompiledDecode:
    """Decode-only steps of `model` over `cache`, compiled at the batch sizes where that wins."""

    stance = "eager_on_recompile"  # torch.compiler's, for every step after the warm-up

    def __init__(
        self,
        model: Generator | Translator,
        cache: PagedKVCache,
        batch_sizes: Sequence[int],
        sources: CrossAttentionCache | None = None,
        compile_cache: CompileCache | None = None,
        background: bool = False,
    ) -> None:
        """Compiles and times the step at each of batch_sizes now, or with `background` on a thread
        of its own (on the cache's null block only: the pool's other blocks are untouched). sources:
        a translator's cross-attention cache (its decode_kernel on), which its steps read (the
        warm-up reads slot 0's). compile_cache: where earlier starts' artifacts are looked up first."""
        assert isinstance(model, Generator) or (sources is not None and sources.decode_kernel), "a translator reads its sources in place"
        self.model, self.cache, self.sources = model, cache, sources
        self.device = cache.keys[0].device
        # Without inductor's size asserts (a check of every tensor an extern kernel returns, about
        # 125 a step): 1.035x at batches 1 and 16, the same logits (docs/performance.md). Without
        # dynamo's guards on the model's modules (about 1,500 checks of a frozen model's attributes
        # at every call, 0.3 ms at batch 1): safe because this instance's graphs are its own (own_code).
        options: dict[str, str | int | bool | Callable[..., Any]] = {
            "size_asserts": False,
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
        }
        named = sorted((name, getattr(value, "__name__", value)) for name, value in options.items())
        self._options = f"{named} {DYNAMO_CONFIG}"  # the compile cache's key names them
        self._compiled = torch.compile(own_code(self._step), dynamic=True, options=options)
        self.timings: dict[int, tuple[float, float]] = {}  # batch size timed -> (eager, compiled) seconds per step
        self.batch_sizes: frozenset[int] = frozenset()  # those that run compiled (none until ready)
        self.ready = threading.Event()
        sizes = sorted(set(batch_sizes))
        if background:
            threading.Thread(target=self._prepare, args=(sizes, compile_cache), name="compiled-decode", daemon=True).start()
        else:
            self._prepare(sizes, compile_cache)

    def _prepare(self, batch_sizes: list[int], compile_cache: CompileCache | None) -> None:
        """The warm-up over the compile cache's artifacts; then the sizes that measured faster run compiled."""
        started = time.perf_counter()
        try:
            key = ""
            if compile_cache is not None:
                parameter = next(self.model.parameters())
                what = [type(self.model).__name__, repr(self.model.config), str(parameter.dtype), self.device.type, repr(batch_sizes)]
                what.append(self._options)
                key = compile_cache.key(*what, "sources" if self.sources is not None else "")
            loaded = compile_cache is not None and compile_cache.load(key)
            self.batch_sizes = self._warm_up(batch_sizes)  # from here on, steps of these sizes run compiled
            if compile_cache is not None and not loaded:
                compile_cache.save(key)
        except Exception:  # a compiler failure leaves every step eager: the engine serves on
            logger.exception("compiling the decode step failed: it stays eager")
        finally:
            self.ready.set()
        logger.info("compiled decode steps after %.0f s: batch sizes %s", time.perf_counter() - started, sorted(self.batch_sizes))

    def _step(self, ids: Tensor, positions: Tensor, key_blocks: Tensor, *sources: Tensor) -> Tensor:
        """Logits (B, V) of one token per sequence: ids and positions (B,) and each row's key blocks
        (B, nb) (decode_blocks); where the new keys go and the attention's mask are made in the
        graph. A translator's sources: each row's source slot (B, 1) and length (B,)."""
        rows = torch.arange(ids.shape[0], device=ids.device)  # (B,)
        block_size = self.cache.block_size
        group = decode_group(rows, key_blocks, positions + 1, block_size, self.model.positions.alibi_slopes)
        step = RaggedStep(cache_slots(key_blocks, positions, block_size), group, [])
        if isinstance(self.model, Translator):
            assert self.sources is not None
            layers = self.sources.bound(*sources)
            return self.model.decode(ids[:, None], layers, None, positions[:, None], self.cache.layers(step))[:, -1]
        return self.model.forward_ragged(ids, positions, self.cache.layers(step), rows)

    def __call__(
        self, ids: Tensor, positions: list[int], tables: list[list[int]], sources: tuple[Tensor, Tensor] | None = None
    ) -> Tensor | None:
        """The logits (B, V) of a decode-only step, compiled: ids (B,), each row's position and its
        block table (holding that position; rows of one sequence share it, each attending up to its
        own position); a translator's rows' sources (CrossAttentionCache.sources). None when its
        batch size runs eagerly."""
        if ids.shape[0] not in self.batch_sizes:
            return None
        key_blocks = decode_blocks(positions, tables, self.cache.block_size, self.device)
        with torch.compiler.set_stance(self.stance):
            return self._compiled(ids, torch.tensor(positions, device=self.device), key_blocks, *(sources or ()))

    @torch.inference_mode()
    def _warm_up(self, batch_sizes: list[int]) -> frozenset[int]:
        """Compiles and times each bucket of batch_sizes; the sizes whose bucket measured faster compiled."""
        faster_sizes: set[int] = set()
        keys = min(WARM_UP_KEYS if self.sources is None else WARM_UP_TRANSLATION_KEYS, self.model.config.max_len)  # within its positions
        for batch, sizes in size_buckets(batch_sizes).items():
            started = time.perf_counter()
            # A second length: where the first graph took a length as a constant, torch recompiles
            # it here with that size symbolic, not at a request (without it, the shipped generator's
            # benchmark at 64 keys recompiled after a warm-up at 256).
            for length in (keys, min(keys, 3 * self.cache.block_size)):
                with torch._dynamo.config.patch(DYNAMO_CONFIG):
                    self._compiled(*self._null_block_step(batch, length))
            compile_seconds = time.perf_counter() - started
            self.timings[batch] = self.time_step(batch, keys, TIMED_STEPS)
            faster = self.timings[batch][1] < self.timings[batch][0]
            if faster:
                faster_sizes |= set(sizes)
            logger.info(
                "decode at batch %d: eager %.1f ms, compiled %.1f ms (compiled in %.0f s): %s at %d-%d",
                batch,
                1e3 * self.timings[batch][0],
                1e3 * self.timings[batch][1],
                compile_seconds,
                "compiled" if faster else "eager",
                sizes[0],
                sizes[-1],
            )
        return frozenset(faster_sizes)

    @torch.inference_mode()
    def time_step(self, batch: int, keys: int, steps: int) -> tuple[float, float]:
        """Median seconds of the eager and the compiled step of `batch` sequences attending over
        `keys` keys (in the null block), the two taking turns `steps` times."""
        inputs = self._null_block_step(batch, keys)
        eager: list[float] = []
        compiled: list[float] = []
        for _ in range(steps):
            for times, step in ((eager, self._step), (compiled, self._compiled)):
                started = time.perf_counter()
                step(*inputs)
                times.append(time.perf_counter() - started)
        return statistics.median(eager), statistics.median(compiled)

    def _null_block_step(self, batch: int, keys: int) -> tuple[Tensor, ...]:
        """Inputs of a step of `batch` sequences at position keys - 1 whose every block is the null
        block (block 0, which no sequence owns): it writes nothing any sequence reads. A
        translator's rows read the first WARM_UP_SOURCE_TOKENS source keys of slot 0 (reading only)."""
        ids = torch.full((batch,), self.model.config.pad_id, device=self.device)
        positions = torch.full((batch,), keys - 1, device=self.device)
        inputs = (ids, positions, decode_blocks([keys - 1] * batch, [[]] * batch, self.cache.block_size, self.device))  # null blocks
        if self.sources is None:
            return inputs
        source_slots = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # (B, 1)
        source_lengths = torch.full((batch,), min(WARM_UP_SOURCE_TOKENS, self.sources.length), device=self.device)  # (B,)
        return (*inputs, source_slots, source_lengths)


def own_code(method: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """method, bound to the same object, with a copy of its code object: torch.compile keeps its
    graphs and their guards per code object, so those of the returned method are its own, never run
    by another instance (with another model) whose modules the guards no longer check."""
    assert isinstance(method, types.MethodType)
    function = method.__func__
    code = function.__code__.replace()  # equal, not the same object
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


def size_buckets(batch_sizes: Sequence[int]) -> dict[int, list[int]]:
    """batch_sizes (ascending) grouped by the bucket each falls in, (2^(k-1), 2^k] (the CUDA graphs'
    buckets, fixed_shape.buckets): each bucket's sizes under its largest, the one a warm-up times."""
    limits = buckets(batch_sizes[-1])
    grouped: dict[int, list[int]] = {}
    for size in batch_sizes:
        grouped.setdefault(bucket(size, limits), []).append(size)
    return {sizes[-1]: sizes for sizes in grouped.values()}


def decode_blocks(positions: list[int], tables: list[list[int]], block_size: int, device: torch.device) -> Tensor:
    """Each row's blocks (B, nb) holding its keys up to its position: nb for the longest, at least
    MIN_KEY_BLOCKS, shorter tables padded with the null block 0 (its keys are masked out)."""
    width = max(MIN_KEY_BLOCKS, -(-(max(positions) + 1) // block_size))
    return torch.tensor([table[:width] + [0] * (width - len(table)) for table in tables], device=device)
