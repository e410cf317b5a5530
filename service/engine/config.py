"""The engine's limits and defaults, and the words its callers share with it (the batching policy,
why a request finished), in one place. No torch here: the serving config that holds an
EngineConfig, and the wire protocol, are read by processes that never load a model."""

import re
from dataclasses import dataclass
from typing import Literal

BatchingPolicy = Literal["continuous", "static"]
# Why a request ended: eos or a stop string, its token limit, the caller left, the model failed, a deadline.
# "constraint": the output could not go on within its structured output (its grammar failed at a
# step, or the finished output broke its schema); the request is answered with the reason, not text.
FinishReason = Literal["stop", "length", "abort", "error", "timeout", "constraint"]


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model at its position, and the `top` most likely
    tokens there (most likely first) as (token, log-probability). Tokens are ids in the engine;
    the replica turns them into their text for the wire (service/protocol.py). A prompt's first
    token, which nothing before it predicts, has logprob None and no top."""

    token: int | str
    logprob: float | None
    top: tuple[tuple[int | str, float], ...] = ()


# What a structured output is written in: a JSON schema, a regular expression, a list of choices,
# an EBNF (GBNF or Lark) grammar, or llguidance's Lark with embedded JSON schemas (tool calls).
GrammarKind = Literal["json", "regex", "choice", "grammar", "lark"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output (vLLM's structured outputs): every token is chosen among
    those the grammar allows next, and the end of sequence only where the grammar is complete."""

    kind: GrammarKind
    spec: str  # json: the schema as JSON text; choice: a JSON list of strings; else the grammar's text
    param: str = "structured_outputs"  # the request field it came from, named when it cannot compile
    strict: bool = False  # json: every property an object schema lists is required (OpenAI's strict)
    # json: the whitespace allowed where JSON allows it, as a regular expression; None: one optional
    # space (service/engine/grammar_check.py DEFAULT_WHITESPACE); "": none
    whitespace: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    # Concurrent sequences (vLLM's max_num_seqs; beams count one each), a translator's KV-cache
    # rows; a decoder-only model's KV pool decides how many of them fit.
    n_slots: int = 256
    # The waiting queue: at most max_waiting requests, and no more tokens (prompts and max_tokens)
    # than the engine computes in queue_timeout_s at its measured speed or, if more, its KV pool
    # holds (Engine.waiting_token_budget). Beyond either, requests are refused at once (429).
    max_waiting: int = 1024
    # Tokens one step computes (vLLM's max_num_batched_tokens): a decoder-only model's running
    # decodes first, then prompt chunks in what is left, so a long prompt is computed over several
    # steps while every stream keeps producing; a translator's running rows (a token each, each
    # beam one), then the sources it admits in what is left, and encoded with them ahead of their
    # admission for the waiting requests next in line.
    max_num_batched_tokens: int = 512
    policy: BatchingPolicy = "continuous"
    max_tokens_cap: int | None = None  # the most tokens one request may ask for (None: what the context allows)
    # Output length when a request sets none (None: the runner's, e.g. what the context allows for
    # the generator, twice the source plus ten for the translator); capped by the limit above.
    default_max_tokens: int | None = None
    # Deadlines from arrival, checked every step: waiting for admission, and until the last token.
    # Past one, the request ends with reason "timeout" and its slots are freed. The total stays
    # below Serve's request_timeout_s (deploy/serve_config.yaml) so the engine ends a request first.
    queue_timeout_s: float | None = 60.0
    request_timeout_s: float | None = 240.0
    # Tokens per sequence: a generator's prompt plus its output, a translator's source and,
    # separately, its output (start token included). None: the model's max positions. Longer
    # prompts are refused; more than the model's positions is an error at load.
    max_context: int | None = None
    # A decoder-only model's KV cache: a pool of blocks of block_size tokens shared by every
    # sequence (model/kv_cache.py PagedKVCache), sized by kv_cache_bytes, or by a share of the
    # GPU's free memory (kv_cache_memory_fraction, CUDA only); neither: what n_slots sequences of
    # the whole context need, at most DEFAULT_KV_CACHE_BYTES, at least one whole context.
    # prefix_caching: full blocks are shared by requests with the same prefix (vLLM's automatic prefix caching).
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    prefix_caching: bool = True
    # Batch sizes (rows) at which a decoder-only model's decode-only steps (a row per sequence, or a
    # row per verified token: max_decode_rows), and a translator's decoder steps (its rows, each
    # beam one; where the CPU attention kernel runs), run compiled by torch.compile
    # (inductor; service/engine/compiled_decode.py): compiled when the replica starts (a minute or
    # two per graph on 2 CPU cores) and timed against the eager step once per power-of-two bucket
    # of sizes, each bucket kept only where the compiled step is faster. Empty: every step eager.
    # Not used where CUDA graphs run the decodes. compile_in_background: the engine serves eagerly
    # meanwhile, and the compiled steps take over once ready. compile_cache: the artifacts are
    # kept between starts (service/engine/compile_cache.py: $TRANSFORMER_SERVING_CACHE/torch-compile).
    compiled_decode: tuple[int, ...] = ()
    compile_in_background: bool = False
    compile_cache: bool = True
    # Structured outputs' grammars are checked and converted in a worker process: a grammar text
    # (schema, regex, choices or EBNF) over grammar_max_bytes, or taking over
    # grammar_compile_timeout_s there, is refused with a 400 (service/engine/grammar_check.py).
    grammar_max_bytes: int = 65536
    grammar_compile_timeout_s: float = 5.0
    # Tokens a grammar forces (JSON keys and punctuation of a schema, a choice's rest once it is
    # unambiguous) are appended without a model step each and computed with the next sampled one
    # (llguidance's fast-forward). Paged KV (decoder-only models) only.
    grammar_fast_forward: bool = True
    # Speculative decoding by prompt lookup (service/engine/speculation.py; decoder-only models):
    # each decoding sequence proposes up to num_speculative_tokens tokens that followed an earlier
    # occurrence of its last prompt_lookup_max ... prompt_lookup_min tokens, and one step verifies
    # them; lossless (the outputs of one token a step, seed for seed). Only while a step decodes at
    # most speculation_max_batch sequences: past that a step is no longer bound by reading the
    # weights, and verifying proposals would cost more than it saves. 0 tokens: off. Not for beams;
    # a structured output proposes what its grammar allows, each row masked after the drafts before it.
    # Where a sequence's own context has no match, the last recent_outputs_tokens tokens of the
    # engine's finished outputs are looked up too (speculation.RecentOutputs, 4-8 MB at the
    # default; 0: not).
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculation_max_batch: int = 8
    recent_outputs_tokens: int = 1 << 13

    # Quantized weights (a GGUF file's, or --quantization; model/block_quant.py): a decode step's
    # activations quantized to 8 bits in blocks of 32, products as integer dot products, as llama.cpp
    # does (x86 with AVX2; 1.0-1.15x the decode speed of float32 activations, benchmarks/gguf.py), or
    # 32: float32 activations, what transformers computes from the same file. Prompts take float32.
    activation_bits: int = 8

    def __post_init__(self) -> None:
        if self.activation_bits not in (8, 32):
            raise ValueError("activation_bits must be 8 or 32")
        if self.n_slots < 1 or self.max_waiting < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("n_slots, max_waiting and max_num_batched_tokens must be at least 1 (a request waits before it runs)")
        if self.block_size < 1 or (self.kv_cache_bytes is not None and self.kv_cache_bytes < 1):
            raise ValueError("block_size and kv_cache_bytes must be at least 1")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if (self.max_tokens_cap is not None and self.max_tokens_cap < 1) or (
            self.default_max_tokens is not None and self.default_max_tokens < 1
        ):
            raise ValueError("max_tokens_cap and default_max_tokens must be at least 1")
        if any(not 1 <= size <= self.max_decode_rows for size in self.compiled_decode):
            raise ValueError(f"compiled_decode batch sizes must be between 1 and max_decode_rows ({self.max_decode_rows})")
        if self.grammar_max_bytes < 1 or self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_max_bytes and grammar_compile_timeout_s must be positive")
        if min(self.num_speculative_tokens, self.speculation_max_batch, self.recent_outputs_tokens) < 0 or not (
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max
        ):
            message = "num_speculative_tokens, speculation_max_batch and recent_outputs_tokens must be at least 0"
            message += ", and 1 <= prompt_lookup_min <= prompt_lookup_max"
            raise ValueError(message)
        if self.max_context is not None and self.max_context < 2:
            raise ValueError("max_context must be at least 2 (a prompt token and one generated)")

    @property
    def max_decode_rows(self) -> int:
        """The most rows a decode step computes: one per sequence (n_slots), or, verifying drafts, one
        per token verified (1 + num_speculative_tokens for each of up to speculation_max_batch sequences)."""
        return max(self.n_slots, min(self.n_slots, self.speculation_max_batch) * (1 + self.num_speculative_tokens))

    def decode_sizes(self, sizes: tuple[int, ...], decoder_only: bool) -> tuple[int, ...]:
        """Of sizes, the row counts this engine's decode steps have: up to max_decode_rows for a
        decoder-only model (a verification of drafts, a row per token), up to n_slots for a translator."""
        rows = self.max_decode_rows if decoder_only else self.n_slots
        return tuple(b for b in sizes if b <= rows)


# Decode steps of up to 64 rows compiled where that measures faster (1.07-1.31x a step on SmolLM2-135M's
# shape, speculation's verifications of up to 8 x 5 rows among them; docs/performance.md): `python -m
# service`'s default; CUDA devices run CUDA graphs instead.
DEFAULT_COMPILED_DECODE = tuple(range(1, 65))


# The KV pool's default ceiling when neither kv_cache_bytes nor kv_cache_memory_fraction is set
# (vLLM's CPU build reserves 4 GiB by default; a replica here shares 24 GB with others).
DEFAULT_KV_CACHE_BYTES = 1 << 30


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """compiled_decode written as text (the command line's, a Serve config's): comma-separated batch
    sizes and ranges, "1,4" or "1-64" (both ends in it), ascending without repeats; "none": ().
    ValueError naming the item that is neither (EngineConfig checks their range)."""
    if text.strip() == "none":
        return ()
    sizes: set[int] = set()
    for item in text.split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if bounds is None or int(bounds[2] or bounds[1]) < int(bounds[1]):
            raise ValueError(f"{item!r} in {text!r} is not a batch size or an ascending range of them (1-64)")
        sizes.update(range(int(bounds[1]), int(bounds[2] or bounds[1]) + 1))
    return tuple(sorted(sizes))


def serving_context(max_context: int | None, model_max_len: int) -> int:
    """The context length the engine serves for a model of model_max_len positions, given
    EngineConfig.max_context; raises ValueError when it asks for more than the model has."""
    if max_context is None:
        return model_max_len
    if max_context > model_max_len:
        raise ValueError(f"max_context {max_context} is beyond the model's {model_max_len} positions; set max_context to at most that")
    return max_context
