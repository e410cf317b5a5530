"""What a structured output's grammar is, and whether it can be served, decided before any token.

A request's constraint becomes llguidance's grammar text here (`grammar_of`), and is checked in a
process of its own (`GrammarChecker`): the GBNF front end is Python and quadratic in a grammar's
lines (1 MB of newlines held the GIL for minutes), so no grammar is converted in the replica's
process. The worker answers the grammar text, or the problem as one line; a grammar over the size
limit is never sent, one over the time limit has its worker killed. The replica then builds the
matcher from the text (llguidance's Rust, which releases the GIL) off the engine's thread.

The check refuses, besides what does not parse: languages with no string at all (`[^\\s\\S]`,
`$ref: "#"`, a `$ref` cycle, a rule without a base case), and grammars whose first steps already
exceed llguidance's parser limits (a choice of more rows than it takes, `"a"{1000000000}`), found
by a probe that walks a few steps from the start. What it cannot see is caught at the step where
it happens (service/engine/engine.py ends the request with reason "constraint").

JSON schemas are closed as vLLM's default backend (xgrammar) reads them: an object schema that
lists `properties` admits no other property unless it says so; `strict` (OpenAI's) also requires
every listed property. Whitespace is bounded: one optional space where JSON allows whitespace,
unless the request gives its own pattern (vLLM's `whitespace_pattern`) or none at all.

Run as `python -m service.engine.grammar_check`: the worker, one JSON line in, one JSON line out.
"""

import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import llguidance

from service.engine.config import StructuredOutput

MAX_CHOICES = 2000  # llguidance's parser takes at most this many alternatives in one rule
DEFAULT_WHITESPACE = " ?"  # where JSON allows whitespace: one space or none
PROBE_STEPS = 8  # tokens the probe consumes along each of its paths
PROBE_PATHS = 8  # first bytes the probe tries
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
READY = b"ready\n"  # the worker's first line


class _Bytes:
    """A vocabulary of the 256 bytes and an end token: what a grammar's language is checked against,
    whatever the model's tokenizer (llguidance's TokenizerWrapper reads these attributes)."""

    def __init__(self) -> None:
        self.tokens = [bytes([b]) for b in range(256)] + [b""]
        self.special_token_ids = [256]
        self.eos_token_id = 256
        self.bos_token_id = None

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def _object_schemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema nested in schema (itself included) that is a JSON object."""
    if isinstance(schema, list):
        for item in schema:
            yield from _object_schemas(item)
    elif isinstance(schema, dict):
        yield schema
        for key, value in schema.items():
            if key not in ("const", "enum", "default", "examples", "required"):
                yield from _object_schemas(value)


def closed_schema(schema: Any, strict: bool) -> Any:
    """The JSON schema as it is compiled: each object schema that lists `properties` and says
    nothing of other properties (`additionalProperties`, `patternProperties`,
    `unevaluatedProperties`) admits none; with strict, every listed property is required too.
    A copy: the argument is not changed."""
    closed = json.loads(json.dumps(schema))
    for node in _object_schemas(closed):
        properties = node.get("properties")
        if not isinstance(properties, dict):
            continue
        if not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & node.keys():
            node["additionalProperties"] = False
        if strict:
            node["required"] = list(properties)
    return closed


def json_options(whitespace: str | None) -> dict[str, Any]:
    """llguidance's JSON options for StructuredOutput.whitespace (None: DEFAULT_WHITESPACE; "": none)."""
    whitespace = DEFAULT_WHITESPACE if whitespace is None else whitespace
    options: dict[str, Any] = {"whitespace_flexible": False}
    if whitespace:
        options["whitespace_pattern"] = whitespace
    return options


def grammar_of(output: StructuredOutput) -> str:
    """The llguidance grammar of a structured output; ValueError when it is not well-formed."""
    if output.kind == "json":
        try:
            schema = json.loads(output.spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema is an object (or true/false)")
        if schema is False:
            raise ValueError("the schema false admits no value")
        spec = closed_schema({} if schema is True else schema, output.strict)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults=json_options(output.whitespace))  # type: ignore[arg-type]
    if output.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(output.spec)
    if output.kind == "choice":
        choices = json.loads(output.spec)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices are served, not {len(choices)}")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if output.kind == "grammar":
        return llguidance.grammar_from("grammar", output.spec)  # Lark, or GBNF converted to Lark
    return llguidance.LLMatcher.grammar_from_lark(output.spec)


def first_line(message: str) -> str:
    return " ".join(message.split("<state>")[0].split())


def _allowed(matcher: llguidance.LLMatcher) -> list[int]:
    mask = matcher.compute_bitmask()
    return [i for i in range(257) if mask[i // 8] >> (i % 8) & 1]


def _probe(matcher: llguidance.LLMatcher) -> str:
    """The problem the grammar shows within a few steps from its start ("" for none): no string
    at all, or a parser limit. Walks PROBE_PATHS paths, each starting with another allowed byte
    and then taking the first byte allowed, PROBE_STEPS bytes or to the end."""
    start = _allowed(matcher)
    if matcher.is_error():
        message = first_line(matcher.get_error())
        return "its language is empty: no output satisfies it" if "NoExtensionBias" in message else message
    for first in start[:PROBE_PATHS]:
        walker, token = matcher.deep_copy(), first
        for _ in range(PROBE_STEPS):
            if token == 256:
                break
            if not walker.consume_token(token) or walker.is_error():
                return first_line(walker.get_error())
            allowed = _allowed(walker)
            if walker.is_error() or not allowed:
                return first_line(walker.get_error()) or "no output satisfies it"
            token = allowed[0]
    return ""


def check(output: StructuredOutput) -> tuple[str | None, str | None]:
    """(the grammar text, None) when the structured output can be served, else (None, the problem
    in one line). Runs in the worker process."""
    try:
        grammar = grammar_of(output)
    except (ValueError, TypeError) as error:
        return None, f"is not a valid {output.kind}: {error}"
    bytes_vocabulary = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=256)
    problem = llguidance.LLMatcher.validate_grammar(grammar, bytes_vocabulary, limits=_LIMITS)
    if problem:
        return None, f"cannot be compiled: {first_line(problem)}"
    matcher = llguidance.LLMatcher(bytes_vocabulary, grammar, log_level=0, limits=_LIMITS)
    problem = first_line(matcher.get_error()) if matcher.is_error() else _probe(matcher)
    return (None, f"cannot be served: {problem}") if problem else (grammar, None)


class GrammarChecker:
    """The worker process and its limits: `grammar(output)` is the grammar text, or raises ValueError
    naming the problem (over max_bytes, over timeout_s, or what `check` finds). Thread-safe; one
    check at a time. The worker starts at the first check and again after a kill."""

    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._worker: subprocess.Popen[bytes] | None = None

    @property
    def worker_pid(self) -> int | None:
        return None if self._worker is None else self._worker.pid

    def grammar(self, output: StructuredOutput) -> str:
        size = len(output.spec.encode())
        if size > self.max_bytes:
            raise ValueError(f"is {size:,} bytes: at most {self.max_bytes:,} are compiled (grammar_max_bytes)")
        line = json.dumps(asdict(output)).encode() + b"\n"
        with self._lock:
            worker = self._started()
            assert worker.stdin is not None and worker.stdout is not None
            ready: list[Any] = []
            try:
                worker.stdin.write(line)
                worker.stdin.flush()
                ready, _, _ = select.select([worker.stdout], [], [], self.timeout_s)
                answer = worker.stdout.readline() if ready else b""
            except OSError:
                answer = b""
            if not answer:
                self._kill()
                if not ready:
                    raise ValueError(f"took more than {self.timeout_s:g} s to compile (grammar_compile_timeout_s)") from None
                raise ValueError("could not be compiled: the grammar compiler failed on it") from None
        grammar, problem = json.loads(answer)
        if problem is not None:
            raise ValueError(problem)
        return str(grammar)

    def _started(self) -> "subprocess.Popen[bytes]":
        """The worker, started when there is none and waited for until it says it is ready (its
        start-up is not counted in a grammar's time)."""
        if self._worker is None or self._worker.poll() is not None:
            environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            command = [sys.executable, "-m", "service.engine.grammar_check"]
            self._worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment)
            assert self._worker.stdout is not None
            if self._worker.stdout.readline() != READY:
                self._kill()
                raise ValueError("could not be compiled: the grammar compiler did not start")
        return self._worker

    def _kill(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker.wait()
            self._worker = None

    def close(self) -> None:
        with self._lock:
            self._kill()


def _serve() -> None:
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    for line in sys.stdin.buffer:
        output = StructuredOutput(**json.loads(line))
        try:
            answer = check(output)
        except Exception as error:  # llguidance's own failure on a grammar: the request's problem, said in one line
            answer = (None, f"cannot be compiled: {type(error).__name__}: {first_line(str(error))}")
        sys.stdout.buffer.write(json.dumps(answer).encode() + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    _serve()
