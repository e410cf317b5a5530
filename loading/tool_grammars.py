"""The grammars that force tool calls (tool_choice "required" or a named function): llguidance's
Lark, with JSON schemas embedded, of a reply made of calls of the given tools only, in a model's
format (loading/tool_formats.py), each call's arguments valid under its tool's parameters."""

import json
from collections.abc import Sequence
from typing import Any

from loading.tool_calls import FunctionTool
from loading.tool_formats import (
    DEEPSEEK_CALL,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CLOSE,
    DEEPSEEK_OPEN,
    DEEPSEEK_SEP,
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_OPEN,
    ToolCallFormat,
)


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


def _literal(text: str) -> str:
    """text as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _parameters_schema(tool: FunctionTool, json_options: dict[str, Any]) -> str:
    return json.dumps({"x-guidance": json_options, **tool.parameters}, ensure_ascii=False)


def _value_schema(tool: FunctionTool, schema: Any, json_options: dict[str, Any]) -> str:
    """A parameter's schema on its own, with the tool's $defs beside it (so "#/$defs/..." resolves)."""
    definitions = tool.parameters.get("$defs")
    return json.dumps({"x-guidance": json_options, **schema, **({"$defs": definitions} if definitions else {})}, ensure_ascii=False)


def _properties(tool: FunctionTool) -> tuple[list[tuple[str, Any]], set[str]]:
    """The tool's listed parameters (name, schema) in order, and the required ones."""
    properties = tool.parameters.get("properties") or {}
    return list(properties.items()), set(tool.parameters.get("required") or [])


def _in_order(items: list[tuple[str, bool]], separator: str) -> str:
    """Lark for the items (rule, required) in their order, separated: each optional one may be left out."""
    sep = f"{_literal(separator)} " if separator else ""
    required = [rule for rule, needed in items if needed]
    optional = [rule for rule, needed in items if not needed]
    if required:
        return " ".join([f" {sep}".join(required), *(f"({sep}{rule})?" for rule in optional)])
    if not optional:
        return ""
    starts = [" ".join([rule, *(f"({sep}{later})?" for later in optional[i + 1 :])]) for i, rule in enumerate(optional)]
    return "(" + " | ".join(starts) + ")?"


def _xml_value(tool: FunctionTool, schema: Any, json_options: dict[str, Any]) -> str:
    """Qwen3-Coder's text of a parameter's value: a string on one line without "<" (a value's
    text runs to its closing tag) within its lengths, a listed string, or any other type's JSON.
    ValueError for a string held to a pattern, a format or a constant."""
    if isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema:
        if any(key in schema for key in ("pattern", "format", "const")):
            raise ValueError(f"{tool.name}: a string held to a pattern, format or const cannot be forced in Qwen3-Coder's calls")
        least, most = schema.get("minLength", 0), schema.get("maxLength", "")
        return f"/[^<\\n]{{{least},{most}}}/"
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(_literal(v) for v in schema["enum"]) + ")"
    return f"%json {_value_schema(tool, schema, json_options)}"


def _python_value(tool: FunctionTool, schema: Any, json_options: dict[str, Any]) -> str:
    """A Python literal of the parameter's value: JSON's for strings, numbers and containers (the
    parser reads JSON's true, false and null inside them), True / False / None for the others."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    return f"%json {_value_schema(tool, schema, json_options)}"


def _calls_rule(calls: list[str], parallel: bool, separator: str) -> str:
    """`call` as any of the call rules, and `calls` one call or (parallel) several separated."""
    rules = [f"call: {' | '.join(f'call{i}' for i in range(len(calls)))}", *calls]
    rules.append(f"calls: call ({_literal(separator)} call)*" if parallel else "calls: call")
    return "\n".join(rules)


NL = "\n"


def forced_call_grammar(format: ToolCallFormat, tools: Sequence[FunctionTool], parallel: bool, json_options: dict[str, Any]) -> str:
    """A Lark grammar (llguidance's, with embedded JSON schemas) of a reply made of tool calls of
    these tools only, in the format: at least one (several when parallel), arguments valid.
    json_options: llguidance's JSON options (whitespace, separators) for the calls' JSON. A marker
    that is a special token of the model's vocabulary is text to the grammar too (its piece is its
    text: loading/tokenizer.py tool_markers), so the model may write it as that token.
    ValueError for a tool the format cannot write (a pythonic call's parameter that is no Python name)."""
    if format == "llama3_json":
        return f"start: %json {json.dumps(_call_schema(tools, 'parameters', json_options))}"
    if format == "mistral":
        schema = _call_schema(tools, "arguments", json_options)
        array = {"x-guidance": json_options, "type": "array", "items": {"anyOf": schema["anyOf"]}, "minItems": 1, "$defs": schema["$defs"]}
        return f"start: {_literal(MISTRAL_OPEN)} %json {json.dumps({**array, **({} if parallel else {'maxItems': 1})})}"
    writers = {"hermes": _hermes_calls, "deepseek_v3": _deepseek_calls, "qwen3_coder": _qwen3_coder_calls, "pythonic": _pythonic_calls}
    return writers[format](tools, parallel, json_options)


def _hermes_calls(tools: Sequence[FunctionTool], parallel: bool, json_options: dict[str, Any]) -> str:
    schema = json.dumps(_call_schema(tools, "arguments", json_options))
    call = f"call0: {_literal(HERMES_OPEN)} {_literal(NL)} %json {schema} {_literal(NL)} {_literal(HERMES_CLOSE)}"
    return "start: calls\n" + _calls_rule([call], parallel, NL)


def _deepseek_calls(tools: Sequence[FunctionTool], parallel: bool, json_options: dict[str, Any]) -> str:
    begin, sep, end = (_literal(m) for m in (DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END))
    calls = [
        f'call{i}: {begin} "function" {sep} {_literal(t.name + NL + "```json" + NL)} %json {_parameters_schema(t, json_options)}'
        f" {_literal(NL + '```')} {end}"
        for i, t in enumerate(tools)
    ]
    start = f"start: {_literal(DEEPSEEK_OPEN)} calls {_literal(DEEPSEEK_CLOSE)}\n"
    return start + _calls_rule(calls, parallel, NL)


def _qwen3_coder_calls(tools: Sequence[FunctionTool], parallel: bool, json_options: dict[str, Any]) -> str:
    rules, calls = [], []
    for i, t in enumerate(tools):
        properties, required = _properties(t)
        for j, (key, schema) in enumerate(properties):
            value = _xml_value(t, schema, json_options)
            rules.append(f"p{i}_{j}: {_literal(f'<parameter={key}>' + NL)} {value} {_literal(NL + '</parameter>' + NL)}")
        body = _in_order([(f"p{i}_{j}", key in required) for j, (key, _) in enumerate(properties)], "")
        head, tail = _literal(f"{NL}<function={t.name}>{NL}"), _literal(f"</function>{NL}")
        calls.append(f"call{i}: {_literal(HERMES_OPEN)} {head} {body} {tail} {_literal(HERMES_CLOSE)}")
    return "start: calls\n" + _calls_rule(calls, parallel, NL) + "\n" + "\n".join(rules)


def _pythonic_calls(tools: Sequence[FunctionTool], parallel: bool, json_options: dict[str, Any]) -> str:
    rules, calls = [], []
    for i, t in enumerate(tools):
        properties, required = _properties(t)
        for j, (key, schema) in enumerate(properties):
            if not key.isidentifier():
                raise ValueError(f"the function {t.name}'s parameter {key!r} is no Python name: a pythonic call cannot pass it")
            rules.append(f"k{i}_{j}: {_literal(key + '=')} {_python_value(t, schema, json_options)}")
        body = _in_order([(f"k{i}_{j}", key in required) for j, (key, _) in enumerate(properties)], ", ")
        calls.append(f"call{i}: {_literal(t.name + '(')} {body} {_literal(')')}")
    return 'start: "[" calls "]"\n' + _calls_rule(calls, parallel, ", ") + "\n" + "\n".join(rules)
