"""Tool calls as chat models write them: which format a chat template asks for, the grammar that
forces a call (tool_choice "required" or a named function), and the parser that splits a reply
into its text and its calls, as the reply streams: a forced call's name as soon as it is written
and its arguments as they are written, other calls whole once they parse.

Two formats, as vLLM's tool parsers of the same names read them:
- "hermes" (Hermes 2 Pro, Qwen2.5): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  any number of them, text before them allowed;
- "llama3_json" (Llama 3.1 / 3.2): the reply is `{"name": ..., "parameters": {...}}` alone (several
  separated by ";").
"""

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
from jinja2 import meta

ToolCallFormat = Literal["hermes", "llama3_json"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: its parameters are a JSON schema (of an object)."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_template_tool(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's `tools` entry)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class CallPiece:
    """A piece of the reply's index-th call: its name on its first piece, and the next fragment of
    its arguments' JSON text (a call's fragments join to its arguments)."""

    index: int
    arguments: str
    name: str | None = None


def tool_call_format(template: str) -> ToolCallFormat | None:
    """The format a chat template's tool section asks for; None when the template does not read
    `tools`, or asks for a format not parsed here."""
    try:
        variables = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return None
    if "tools" not in variables:
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return None


def _moved_references(schema: Any, home: str) -> Any:
    """The schema with its root-relative references ("#", "#/...") pointing into `home` (a JSON
    pointer, where the schema is placed inside another); values (const, enum, ...) left as they are."""
    if isinstance(schema, list):
        return [_moved_references(item, home) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = home + value[1:]
        elif key in ("const", "enum", "default", "examples"):
            moved[key] = value
        else:
            moved[key] = _moved_references(value, home)
    return moved


def _call_schema(tools: Sequence[FunctionTool], arguments_key: str, json_options: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema of one call of any of the tools: its name, then arguments that match its
    parameters. Each tool's parameters sit in the root's $defs (their own $defs and root references
    moved with them), so that a pydantic-style "#/$defs/..." still resolves."""
    return {
        "x-guidance": json_options,
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, arguments_key: {"$ref": f"#/$defs/tool{i}"}},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for i, t in enumerate(tools)
        ],
        "$defs": {f"tool{i}": _moved_references(t.parameters, f"#/$defs/tool{i}") for i, t in enumerate(tools)},
    }


def forced_call_grammar(format: ToolCallFormat, tools: Sequence[FunctionTool], parallel: bool, json_options: dict[str, Any]) -> str:
    """A Lark grammar (llguidance's, with embedded JSON schemas) of a reply made of tool calls of
    these tools only, in the format: at least one (several when parallel), arguments valid.
    json_options: llguidance's JSON options (whitespace, separators) for the calls' JSON."""
    if format == "llama3_json":
        return f"start: %json {json.dumps(_call_schema(tools, 'parameters', json_options))}"
    call = f'call: "{HERMES_OPEN}\\n" %json {json.dumps(_call_schema(tools, "arguments", json_options))} "\\n{HERMES_CLOSE}"'
    return ('start: call ("\\n" call)*' if parallel else "start: call") + "\n" + call


def _parsed(text: str, arguments_key: str) -> ParsedCall | None:
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get(arguments_key, call.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def _unless_space(text: str) -> str:
    """text, or "" when it is whitespace alone (around forced calls, whose grammar allows nothing else)."""
    return text if text.strip() else ""


def _held_back(text: str, marker: str) -> int:
    """The length of text's longest suffix that begins marker (it may be the marker's start)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


class CallScanner:
    """One call's JSON object, `{"name": ..., "<arguments_key>": {...}}`, read as its text arrives:
    its name once the name's string is whole, the arguments object's text as it comes (held back
    until the name is known), and where the object ends. Keys are read at the object's top level
    only."""

    def __init__(self, arguments_key: str) -> None:
        self.arguments_key = arguments_key
        self.text = ""
        self.depth = 0
        self.in_string, self.escaped, self.string_start = False, False, 0
        self.pending_key: str | None = None  # the last top-level string before a colon
        self.key: str | None = None  # the top-level key whose value is being read
        self.name: str | None = None
        self.name_sent = False
        self.arguments_start: int | None = None
        self.arguments_end: int | None = None
        self.sent = 0  # characters of the arguments handed out

    def feed(self, text: str) -> tuple[str | None, str, str | None]:
        """(the name, on the feed that first knows it; the arguments' text this feed adds; the text
        after the object, once it has ended, else None)."""
        begin = len(self.text)
        self.text += text
        rest = None
        for i in range(begin, len(self.text)):
            if self._ended_at(i):
                self.text, rest = self.text[: i + 1], self.text[i + 1 :]
                break
        name = None
        if self.name is not None and not self.name_sent:
            name, self.name_sent = self.name, True
        fragment = ""
        if self.name_sent and self.arguments_start is not None:
            arguments = self.text[self.arguments_start : self.arguments_end]
            fragment, self.sent = arguments[self.sent :], len(arguments)
        return name, fragment, rest

    def _ended_at(self, i: int) -> bool:
        """Reads character i; whether it closes the object."""
        c = self.text[i]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    value = json.loads(self.text[self.string_start : i + 1])
                    if self.key is None:
                        self.pending_key = value
                    elif self.key == "name" and self.name is None:
                        self.name = value
            return False
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c == ":" and self.depth == 1:
            self.key = self.pending_key
        elif c == "," and self.depth == 1:
            self.key = None
        elif c in "{[":
            if self.depth == 1 and self.key == self.arguments_key and self.arguments_start is None:
                self.arguments_start = i
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.arguments_start is not None and self.arguments_end is None:
                self.arguments_end = i + 1
            return self.depth == 0
        return False


class ToolCallParser:
    """A reply's text fed as it streams, split into content and calls. feed() returns the content
    that is certain to be content and pieces of calls; close() what remains at the end.

    Whole calls (stream_arguments False, as under tool_choice "auto"): a call is given in one piece
    once it has ended and parses; a call cut short, that does not parse, or that names a function
    not in `declared` is content: a client that runs the calls it gets never gets one it did not
    offer. Streamed calls (stream_arguments True: a forced call, whose grammar holds it to a
    declared function and its parameters): the name as soon as it is written, then the arguments
    as they are written."""

    def __init__(self, format: ToolCallFormat, declared: frozenset[str], stream_arguments: bool = False) -> None:
        self.format = format
        self.declared = declared
        self.stream_arguments = stream_arguments
        self._buffer = ""
        self._in_call = False  # hermes: inside <tool_call>; llama3_json: the reply is a call
        self._started = False  # llama3_json: the reply's first non-space character was seen
        self._scanner: CallScanner | None = None  # streamed: the call being read
        self._closing = False  # streamed hermes: after a call's object, before its closing tag
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        if self.stream_arguments:
            return self._feed_streamed()
        if self.format == "llama3_json":
            return self._feed_json()
        content, calls = "", list[ParsedCall]()
        while True:
            if not self._in_call:
                start = self._buffer.find(HERMES_OPEN)
                if start < 0:
                    keep = _held_back(self._buffer, HERMES_OPEN)
                    content += self._between(self._buffer[: len(self._buffer) - keep], bool(calls))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += self._between(self._buffer[:start], bool(calls))
                self._buffer, self._in_call = self._buffer[start + len(HERMES_OPEN) :], True
            end = self._buffer.find(HERMES_CLOSE)
            if end < 0:
                break
            body, self._buffer, self._in_call = self._buffer[:end], self._buffer[end + len(HERMES_CLOSE) :], False
            call = self._declared(_parsed(body.strip(), "arguments"))
            if call is None:
                content += HERMES_OPEN + body + HERMES_CLOSE
            else:
                calls.append(call)
        return content, self._pieces(calls)

    def _feed_json(self) -> tuple[str, list[CallPiece]]:
        if not self._started and self._buffer.strip():
            self._started, self._in_call = True, self._buffer.lstrip().startswith("{")
        if self._in_call or not self._started:
            return "", []
        content, self._buffer = self._buffer, ""
        return content, []

    def _feed_streamed(self) -> tuple[str, list[CallPiece]]:
        """Calls as they are written, in a reply its grammar holds to calls (and whitespace between them)."""
        hermes = self.format == "hermes"
        opener = HERMES_OPEN if hermes else "{"
        content, pieces = "", list[CallPiece]()
        while True:
            if self._closing:  # the text between a call's object and its closing tag
                end = self._buffer.find(HERMES_CLOSE)
                if end < 0:
                    break
                self._buffer, self._closing = self._buffer[end + len(HERMES_CLOSE) :], False
            if self._scanner is None:
                start = self._buffer.find(opener)
                if start < 0:
                    keep = _held_back(self._buffer, opener) if hermes else 0
                    content += _unless_space(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += _unless_space(self._buffer[:start])
                self._buffer = self._buffer[start + len(HERMES_OPEN) :] if hermes else self._buffer[start:]
                self._scanner = CallScanner("arguments" if hermes else "parameters")
            name, fragment, rest = self._scanner.feed(self._buffer)
            self._buffer = ""
            if name is not None or fragment:
                pieces.append(CallPiece(self.calls, fragment, name))
            if rest is None:
                break
            self._buffer, self._scanner, self._closing = rest, None, hermes
            self.calls += 1
        return content, pieces

    def close(self) -> tuple[str, list[CallPiece]]:
        rest, self._buffer = self._buffer, ""
        if self.stream_arguments:
            return ("" if self._scanner is not None or self._closing else _unless_space(rest)), []
        if not self._in_call:
            return self._between(rest, False), []
        if self.format == "llama3_json":
            calls = [self._declared(_parsed(part, "parameters")) for part in re.split(r"\s*;\s*(?=\{)", rest.strip())]
            found = [c for c in calls if c is not None]
            return ("", self._pieces(found)) if found and len(found) == len(calls) else (rest, [])
        call = self._declared(_parsed(rest.strip(), "arguments"))  # a call whose closing tag never came
        return ("", self._pieces([call])) if call else (HERMES_OPEN + rest, [])

    def _pieces(self, calls: list[ParsedCall]) -> list[CallPiece]:
        """Whole calls as one piece each, numbered on from the calls before them."""
        pieces = [CallPiece(self.calls + i, call.arguments, call.name) for i, call in enumerate(calls)]
        self.calls += len(calls)
        return pieces

    def _declared(self, call: ParsedCall | None) -> ParsedCall | None:
        return call if call is not None and call.name in self.declared else None

    def _between(self, text: str, called_now: bool) -> str:
        """Text outside calls, less the whitespace between and after calls."""
        return "" if (self.calls or called_now) and not text.strip() else text
