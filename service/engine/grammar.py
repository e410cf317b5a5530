"""Structured outputs: the tokens a request's grammar allows next, as a mask on its logits.

The grammars run on llguidance (the Rust core of Microsoft's Guidance, one of vLLM's three
structured-output backends). Chosen over xgrammar (vLLM's default) and outlines-core because it is
one 3 MB wheel with no dependencies (xgrammar brings triton and a TVM runtime), it reads JSON
schemas, regular expressions, Lark and GBNF alike, and its parser computes a mask lazily from a
token trie in tens of microseconds, with no per-schema precomputation over the vocabulary: a new
schema costs under a millisecond to compile, which this module still does once per schema.
Each new grammar is first checked and converted in a worker process, bounded in size and time
(service/engine/grammar_check.py), and built here from the text it answers, off the engine's thread.

A step's masks are computed on a worker thread while the model computes the step's logits (as vLLM
overlaps them with the forward), then applied to the rows that sample (`GrammarMasks.apply`); the
engine advances each request's matcher with the token it sampled.
"""

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jsonschema
import llguidance
import torch
from torch import Tensor

from loading.tokenizer import TextTokenizer
from service.engine.config import StructuredOutput
from service.engine.errors import InvalidRequestError
from service.engine.grammar_check import GrammarChecker, closed_schema, first_line
from service.engine.request import Request

CACHED_GRAMMARS = 256  # compiled grammars kept (and refusals remembered), least recently used dropped first
_BITS = torch.arange(32, dtype=torch.int32)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer: every id's bytes as it follows other
    text (special ids have none and are listed as special; only an eos among them is ever allowed),
    and an encoder."""

    def __init__(self, tokenizer: TextTokenizer, eos_id: int) -> None:
        self.tokens = [tokenizer.piece_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i, piece in enumerate(self.tokens) if not piece]
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = {key for key in keys if keys.count(key) > 1}
    if repeated:
        raise ValueError(f"the key {sorted(repeated)[0]!r} appears twice in one object")
    return dict(pairs)


def json_problem(output: StructuredOutput, text: str) -> str | None:
    """Why a finished output breaks its JSON schema (None when it holds): a key twice in one
    object (which a grammar cannot rule out where other properties are allowed), or any keyword
    the grammar only approximates, checked by jsonschema against the schema as compiled."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except ValueError as not_json:
        return str(not_json)
    schema = closed_schema(json.loads(output.spec), output.strict)
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        broken = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except Exception:  # a schema jsonschema cannot evaluate (llguidance read it): the grammar's word stands
        return None
    return None if broken is None else f"{broken.message} (at {broken.json_path})"


class GrammarCompiler:
    """One engine's grammars: compiled once per structured output (kept while used; a refusal is
    remembered alike), and a matcher per request. Thread-safe: compiled on callers' threads (the
    async engine's workers), never on the engine's."""

    def __init__(self, tokenizer: TextTokenizer, eos_ids: frozenset[int], max_bytes: int, timeout_s: float) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = sorted(eos_ids)
        self.checker = GrammarChecker(max_bytes, timeout_s)
        self._vocabulary: llguidance.LLTokenizer | None = None  # built at the first structured request
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher | str] = OrderedDict()  # a str: the refusal
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None  # with the vocabulary: an engine that never sees a grammar starts no thread
        self._worker: ThreadPoolExecutor | None = None

    @property
    def in_use(self) -> bool:
        """Whether any grammar was compiled (else no request can have a matcher)."""
        return bool(self._compiled)

    def _compile(self, output: StructuredOutput) -> llguidance.LLMatcher | str:
        with self._lock:
            if self._vocabulary is None:
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer, self._eos_ids[0]))
                self._vocabulary = llguidance.LLTokenizer(wrapper, n_vocab=self._tokenizer.vocab_size, eos_token=self._eos_ids)
                self._executor = llguidance.LLExecutor()
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        try:
            grammar = self.checker.grammar(output)
        except ValueError as error:
            return f"{output.param} {error}"
        matcher = llguidance.LLMatcher(self._vocabulary, grammar, log_level=0)  # releases the GIL while it builds
        probe = matcher.deep_copy()
        if not matcher.is_error():
            probe.compute_bitmask()  # the first mask over this vocabulary: an error when none of its tokens starts the output
        if matcher.is_error() or probe.is_error():
            problem = matcher.get_error() if matcher.is_error() else probe.get_error()
            return f"{output.param} cannot be served with this model's vocabulary: {first_line(problem)}"
        return matcher

    def matcher(self, output: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher of the structured output, at its start; InvalidRequestError (naming
        output.param) when its grammar cannot be served."""
        return self.compiled(output).deep_copy()

    def compiled(self, output: StructuredOutput) -> llguidance.LLMatcher:
        """The structured output's compiled matcher (compiled now when new, then kept): not to be
        advanced, only copied; InvalidRequestError (naming output.param) when it cannot be served."""
        with self._lock:
            compiled = self._compiled.get(output)
            if compiled is not None:
                self._compiled.move_to_end(output)
        if compiled is None:
            compiled = self._compile(output)  # outside the lock: a slow grammar holds up no cached one
            with self._lock:
                self._compiled[output] = compiled
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        if isinstance(compiled, str):
            raise InvalidRequestError(compiled, output.param)
        return compiled

    def masks(self, requests: list[Request], drafts: dict[str, list[int]]) -> "GrammarMasks | None":
        """The next-token masks of the requests that have a matcher, started on the worker thread:
        one for the next token, and one after each of its drafts (speculative decoding; the
        matchers are left where they were); None when none has one."""
        constrained = [r for r in requests if r.grammar is not None]
        if not constrained:
            return None
        assert self._executor is not None and self._worker is not None, "a matcher comes from a compiled grammar"
        width = (self._tokenizer.vocab_size + 31) // 32  # int32 words of one row
        firsts, rows = {}, 0
        for r in constrained:
            firsts[r.request_id], rows = rows, rows + 1 + len(drafts.get(r.request_id, ()))
        bitmask = torch.zeros(rows, width, dtype=torch.int32)  # (K, W): a bit per token id (a row a draft cut short leaves: none)
        plain, drafted = [], []
        for r in constrained:
            assert r.grammar is not None
            if drafts.get(r.request_id):
                drafted.append((r.grammar, firsts[r.request_id], drafts[r.request_id]))
            else:
                plain.append((r.grammar, firsts[r.request_id]))
        executor = self._executor

        def compute() -> None:  # llguidance takes drafted matchers (with their drafts) apart
            if plain:
                executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), width * 4, rows)
            if drafted:
                executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), width * 4, rows)

        return GrammarMasks(firsts, bitmask, self._worker.submit(compute))


class GrammarMasks:
    """One step's masks: row i of bitmask (K, W) allows token t where bit t % 32 of word t // 32 is
    set; a request's rows start at rows[id]: its next token's, then one after each of its drafts."""

    def __init__(self, rows: dict[str, int], bitmask: Tensor, done: "Future[None]") -> None:
        self.rows = rows
        self.bitmask = bitmask
        self.done = done

    def apply(self, logits: Tensor, request_ids: list[str]) -> None:
        """logits (R, V), a row per request id in order (a request with drafts: its rows in order,
        its id on each): each constrained row's disallowed tokens set to -inf in place (ids past
        the tokenizer's vocabulary are never allowed)."""
        seen: dict[str, int] = {}
        at = []
        for i, r in enumerate(request_ids):
            if r in self.rows:
                at.append((i, self.rows[r] + seen.get(r, 0)))
                seen[r] = seen.get(r, 0) + 1
        if not at:
            return
        self.done.result()
        words = self.bitmask.index_select(0, torch.tensor([row for _, row in at]))  # (K, W)
        allowed = ((words.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)  # (K, 32 W)
        vocab = logits.shape[-1]
        allowed = allowed[:, :vocab] if allowed.shape[1] >= vocab else torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        index = torch.tensor([i for i, _ in at], device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed.to(logits.device), float("-inf")))
