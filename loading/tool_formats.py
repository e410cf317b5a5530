"""The tool-call formats of the model families people serve, as vLLM's tool parsers of the same
names read them: where a reply's calls are (the markers around them) and how the text between
the markers reads as calls. loading/tool_calls.py finds the format in a chat template and splits
a streamed reply with it; loading/tool_grammars.py writes the grammar that forces calls in it.

- "hermes" (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  any number of them, text before them allowed;
- "qwen3_coder" (Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  ...</function>\\n</tool_call>`, any number; a value is text, read by its parameter's type (a
  string as it is, anything else as JSON);
- "mistral" (Mistral 7B v0.3, Nemo, Small): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`,
  or `[TOOL_CALLS]NAME[ARGS]{...}` repeated (newer tokenizers), to the reply's end, text before
  allowed;
- "deepseek_v3": `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`, text before allowed;
- "llama3_json" (Llama 3.1 / 3.2): the reply is `{"name": ..., "parameters": {...}}` alone
  (several separated by ";");
- "pythonic" (Llama 3.2 / 4's pythonic templates): the reply is `[f(a=1, b="x"), g()]` alone,
  Python literals as values (JSON's true, false and null read too).
"""

import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

ToolCallFormat = Literal["hermes", "qwen3_coder", "mistral", "deepseek_v3", "llama3_json", "pythonic"]
Schemas = Mapping[str, dict[str, Any]]  # each declared function's parameters (a JSON schema), by name

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
DEEPSEEK_OPEN, DEEPSEEK_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class CallSyntax:
    """Where a format's calls are: after `open` (text before it is content) up to `close` (None:
    the reply's end); with open None, the whole reply when its first non-space character is
    `first`. `calls` reads the text between as calls (None when it does not parse)."""

    open: str | None
    close: str | None
    first: str
    calls: Callable[[str, Schemas], list[ParsedCall] | None]


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
        return None
    return value if isinstance(value, dict) else None


def _call_of(value: Any, arguments_key: str) -> ParsedCall | None:
    """{"name": ..., arguments_key (or "arguments"): {...} (or its JSON text)} as a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        arguments = _json_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _all(calls: list[ParsedCall | None]) -> list[ParsedCall] | None:
    found = [c for c in calls if c is not None]
    return found if found and len(found) == len(calls) else None


def hermes_calls(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    return _all([_call_of(_json_object(body.strip()), "arguments")])


def llama3_json_calls(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    return _all([_call_of(_json_object(part), "parameters") for part in re.split(r"\s*;\s*(?=\{)", body.strip())])


def mistral_calls(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """A JSON list of calls, or NAME[ARGS]{...} repeated."""
    text = body.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
            return None
        return _all([_call_of(item, "arguments") for item in items]) if isinstance(items, list) else None
    calls: list[ParsedCall | None] = []
    decoder = json.JSONDecoder()
    while text:
        name, marker, rest = text.partition(MISTRAL_ARGS)
        if not marker or not re.fullmatch(r"[\w.-]+", name.strip()):
            return None
        try:
            arguments, end = decoder.raw_decode(rest.lstrip())
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
            return None
        calls.append(_call_of({"name": name.strip(), "arguments": arguments}, "arguments"))
        text = rest.lstrip()[end:].strip()
    return _all(calls)


DEEPSEEK_CALL_TEXT = re.compile(
    re.escape(DEEPSEEK_CALL) + r"function" + re.escape(DEEPSEEK_SEP) + r"([^\n]+)\n```json\n(.*?)\n```" + re.escape(DEEPSEEK_CALL_END), re.S
)


def deepseek_v3_calls(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """One or more call blocks, whitespace around them."""
    calls: list[ParsedCall | None] = []
    at, text = 0, body.strip()
    while at < len(text):
        match = DEEPSEEK_CALL_TEXT.match(text, at)
        if match is None:
            return None
        calls.append(_call_of({"name": match[1].strip(), "arguments": _json_object(match[2])}, "arguments"))
        at = match.end()
        while at < len(text) and text[at].isspace():
            at += 1
    return _all(calls)


QWEN3_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
QWEN3_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


def _typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type reads it: a string as it is; anything else as JSON
    (as text when it is not JSON)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return text
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
        return text


def qwen3_coder_calls(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    match = QWEN3_FUNCTION.fullmatch(body)
    if match is None:
        return None
    name = match[1].strip()
    properties = schemas.get(name, {}).get("properties", {})
    arguments: dict[str, Any] = {}
    at, text = 0, match[2].lstrip()
    while at < len(text):
        parameter = QWEN3_PARAMETER.match(text, at)
        if parameter is None:
            return None
        key = parameter[1].strip()
        arguments[key] = _typed_value(parameter[2], properties.get(key) if isinstance(properties, dict) else None)
        at = parameter.end()
    return [ParsedCall(name, json.dumps(arguments, ensure_ascii=False))]


PYTHON_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A Python literal (or JSON's true, false, null) as JSON's value; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in PYTHON_NAMES:
        return PYTHON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    raise ValueError("not a literal")


def pythonic_calls(body: str, schemas: Schemas) -> list[ParsedCall] | None:
    """`[f(a=1), g(b="x")]`: keyword arguments only, literal values (read, never run)."""
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[ParsedCall | None] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args or any(k.arg is None for k in node.keywords):
            return None
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return _all(calls)


def call_id(format: ToolCallFormat) -> str:
    """A new call's id: 9 letters and digits for Mistral (its templates refuse others), `call_` and
    24 hexadecimal digits otherwise (as OpenAI's)."""
    if format == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


SYNTAX: dict[ToolCallFormat, CallSyntax] = {
    "hermes": CallSyntax(HERMES_OPEN, HERMES_CLOSE, "", hermes_calls),
    "qwen3_coder": CallSyntax(HERMES_OPEN, HERMES_CLOSE, "", qwen3_coder_calls),
    "mistral": CallSyntax(MISTRAL_OPEN, None, "", mistral_calls),
    "deepseek_v3": CallSyntax(DEEPSEEK_OPEN, DEEPSEEK_CLOSE, "", deepseek_v3_calls),
    "llama3_json": CallSyntax(None, None, "{", llama3_json_calls),
    "pythonic": CallSyntax(None, None, "[", pythonic_calls),
}
# The special tokens a format's markers may be in a model's vocabulary (to be kept in its replies' text).
MARKERS: dict[ToolCallFormat, tuple[str, ...]] = {
    "hermes": (HERMES_OPEN, HERMES_CLOSE),
    "qwen3_coder": (HERMES_OPEN, HERMES_CLOSE),
    "mistral": (MISTRAL_OPEN, MISTRAL_ARGS),
    "deepseek_v3": (DEEPSEEK_OPEN, DEEPSEEK_CLOSE, DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END),
    "llama3_json": (),
    "pythonic": (),
}
