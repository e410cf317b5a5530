"""Tool calls as chat models write them: which format a chat template asks for (the formats:
loading/tool_formats.py), and the parser that splits a reply into its text and its calls as the
reply streams: a forced call's name as soon as it is written and its arguments as they are written
(the JSON formats), other calls whole once they parse. The grammar that forces calls:
loading/tool_grammars.py.
"""

import json
import re
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta

from loading.tool_formats import HERMES_CLOSE, HERMES_OPEN, MISTRAL_OPEN, SYNTAX, ParsedCall, Schemas, ToolCallFormat

# The formats whose forced calls stream as they are written: a call is a JSON object whose name
# comes before its arguments (the forced grammar writes them in that order), with its opener.
STREAMED: dict[ToolCallFormat, tuple[str, str]] = {"hermes": (HERMES_OPEN, "arguments"), "llama3_json": ("{", "parameters")}


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
class CallPiece:
    """A piece of the reply's index-th call: its name on its first piece, and the next fragment of
    its arguments' JSON text (a call's fragments join to its arguments)."""

    index: int
    arguments: str
    name: str | None = None


def tool_call_format(template: str) -> ToolCallFormat | None:
    """The format a chat template's tool section asks for (the markers or the instructions it
    writes); None when the template does not read `tools`, or asks for a format not parsed here."""
    try:
        variables = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return None
    if "tools" not in variables:
        return None
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_OPEN in template:
        return "mistral"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if re.search(r"\[func_name\d*\(", template):
        return "pythonic"
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return None


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

    Whole calls (stream_arguments False, as under tool_choice "auto", and in formats other than
    STREAMED): the calls between a format's markers are given in one piece each once their text
    has ended and parses; text that cuts them short, does not parse, or names a function not in
    `declared` is content: a client that runs the calls it gets never gets one it did not offer.
    Streamed calls (stream_arguments True, a STREAMED format: a forced call, whose grammar holds it
    to a declared function and its parameters): the name as soon as it is written, then the
    arguments as they are written."""

    def __init__(self, format: ToolCallFormat, declared: Schemas, stream_arguments: bool = False) -> None:
        self.format = format
        self.syntax = SYNTAX[format]
        self.declared = declared
        self.stream_arguments = stream_arguments and format in STREAMED
        self._buffer = ""
        self._in_call = False  # inside a format's markers, or a reply that is calls
        self._started = False  # formats without markers: the reply's first non-space character was seen
        self._scanner: CallScanner | None = None  # streamed: the call being read
        self._closing = False  # streamed hermes: after a call's object, before its closing tag
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        if self.stream_arguments:
            return self._feed_streamed()
        if self.syntax.open is None:
            return self._feed_whole_reply()
        opener, closer = self.syntax.open, self.syntax.close
        content, calls = "", list[ParsedCall]()
        while True:
            if not self._in_call:
                start = self._buffer.find(opener)
                if start < 0:
                    keep = _held_back(self._buffer, opener)
                    content += self._between(self._buffer[: len(self._buffer) - keep], bool(calls))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += self._between(self._buffer[:start], bool(calls))
                self._buffer, self._in_call = self._buffer[start + len(opener) :], True
            end = -1 if closer is None else self._buffer.find(closer)
            if closer is None or end < 0:
                break  # calls to the reply's end are read by close()
            body, self._buffer, self._in_call = self._buffer[:end], self._buffer[end + len(closer) :], False
            found = self._declared(self.syntax.calls(body, self.declared))
            if found is None:
                content += opener + body + closer
            else:
                calls += found
        return content, self._pieces(calls)

    def _feed_whole_reply(self) -> tuple[str, list[CallPiece]]:
        if not self._started and self._buffer.strip():
            self._started, self._in_call = True, self._buffer.lstrip().startswith(self.syntax.first)
        if self._in_call or not self._started:
            return "", []
        content, self._buffer = self._buffer, ""
        return content, []

    def _feed_streamed(self) -> tuple[str, list[CallPiece]]:
        """Calls as they are written, in a reply its grammar holds to calls (and whitespace between them)."""
        opener, arguments_key = STREAMED[self.format]
        marked = opener != "{"  # hermes: the opener is a marker before the object, not its first character
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
                    keep = _held_back(self._buffer, opener) if marked else 0
                    content += _unless_space(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += _unless_space(self._buffer[:start])
                self._buffer = self._buffer[start + len(opener) :] if marked else self._buffer[start:]
                self._scanner = CallScanner(arguments_key)
            name, fragment, rest = self._scanner.feed(self._buffer)
            self._buffer = ""
            if name is not None or fragment:
                pieces.append(CallPiece(self.calls, fragment, name))
            if rest is None:
                break
            self._buffer, self._scanner, self._closing = rest, None, marked
            self.calls += 1
        return content, pieces

    def close(self) -> tuple[str, list[CallPiece]]:
        rest, self._buffer = self._buffer, ""
        if self.stream_arguments:
            return ("" if self._scanner is not None or self._closing else _unless_space(rest)), []
        if not self._in_call:
            return self._between(rest, False), []
        found = self._declared(self.syntax.calls(rest, self.declared))  # calls to the end, or whose closing marker never came
        if found is not None:
            return "", self._pieces(found)
        return (self.syntax.open or "") + rest, []

    def _pieces(self, calls: list[ParsedCall]) -> list[CallPiece]:
        """Whole calls as one piece each, numbered on from the calls before them."""
        pieces = [CallPiece(self.calls + i, call.arguments, call.name) for i, call in enumerate(calls)]
        self.calls += len(calls)
        return pieces

    def _declared(self, calls: list[ParsedCall] | None) -> list[ParsedCall] | None:
        """The calls, when every one names a declared function."""
        return calls if calls is not None and all(c.name in self.declared for c in calls) else None

    def _between(self, text: str, called_now: bool) -> str:
        """Text outside calls, less the whitespace between and after calls."""
        return "" if (self.calls or called_now) and not text.strip() else text


def _unless_space(text: str) -> str:
    """text, or "" when it is whitespace alone (around forced calls, whose grammar allows nothing else)."""
    return text if text.strip() else ""


def _held_back(text: str, marker: str) -> int:
    """The length of text's longest suffix that begins marker (it may be the marker's start)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)
