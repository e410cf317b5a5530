"""The tool-call formats beyond Hermes and Llama 3.1 JSON (loading/tool_formats.py): Qwen3-Coder's
XML, Mistral's [TOOL_CALLS] (both forms), DeepSeek V3's markers and the pythonic list, each read
from its chat template, parsed however its reply is cut (text before calls kept, a malformed or
undeclared call kept as text), and forced by its grammar: every reply the grammar allows parses
into calls of the given tools whose arguments validate against their parameters."""

import json

import jsonschema
import llguidance
import pytest

from loading.tool_calls import STREAMED, FunctionTool, tool_call_format
from loading.tool_formats import ParsedCall, Schemas
from loading.tool_grammars import forced_call_grammar
from tests.model.test_tool_calls import byte_tokenizer, parse_in_pieces

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
)
SWITCH = FunctionTool(
    "set_light",
    None,
    {
        "type": "object",
        "properties": {"on": {"type": "boolean"}, "levels": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
        "required": ["on"],
        "additionalProperties": False,
    },
)
TIME = FunctionTool("get_time", None, {"type": "object", "properties": {}, "additionalProperties": False})
TOOLS = [WEATHER, SWITCH, TIME]
DECLARED: Schemas = {t.name: t.parameters for t in TOOLS}
JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": " ?"}
EXPECTED = [ParsedCall("get_weather", '{"city": "Köln", "days": 2}'), ParsedCall("set_light", '{"on": true, "levels": [0.5]}')]
REPLIES = {
    "qwen3_coder": (
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=set_light>\n<parameter=on>\ntrue\n</parameter>\n"
        "<parameter=levels>\n[0.5]\n</parameter>\n</function>\n</tool_call>"
    ),
    "mistral": 'Let me look.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Köln", "days": 2}}, '
    '{"name": "set_light", "arguments": {"on": true, "levels": [0.5]}}]',
    "deepseek_v3": (
        "Let me look.\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Köln", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>set_light\n```json\n'
        '{"on": true, "levels": [0.5]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "pythonic": '[get_weather(city="Köln", days=2), set_light(on=True, levels=[0.5])]',
}
CONTENT = {"qwen3_coder": "Let me look.\n", "mistral": "Let me look.\n", "deepseek_v3": "Let me look.\n", "pythonic": ""}


@pytest.mark.parametrize("size", [1, 2, 5, 13, 10_000])
@pytest.mark.parametrize("format", list(REPLIES))
def test_each_formats_calls_are_parsed_however_the_reply_is_cut(format: str, size: int) -> None:
    assert parse_in_pieces(format, REPLIES[format], size, DECLARED) == (CONTENT[format], EXPECTED)


def test_mistrals_newer_form_and_json_true_false_null_in_pythonic_calls() -> None:
    reply = '[TOOL_CALLS]get_weather[ARGS]{"city": "Köln", "days": 2}set_light[ARGS]{"on": true, "levels": [0.5]}'
    assert parse_in_pieces("mistral", reply, 3, DECLARED) == ("", EXPECTED)
    reply = '[set_light(on=true, levels=[0.5]), get_weather(city="Köln", days=None)]'
    assert parse_in_pieces("pythonic", reply, 4, DECLARED)[1] == [
        ParsedCall("set_light", '{"on": true, "levels": [0.5]}'),
        ParsedCall("get_weather", '{"city": "Köln", "days": null}'),
    ]


@pytest.mark.parametrize(
    ("format", "reply"),
    [
        ("qwen3_coder", "<tool_call>\n<function=delete_all_files>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\nno parameters here\n</function>\n</tool_call>"),
        ("mistral", '[TOOL_CALLS][{"name": "delete_all_files", "arguments": {"path": "/"}}]'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '),
        ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city"'),
        ("pythonic", '[delete_all_files(path="/")]'),
        ("pythonic", '[get_weather(city=__import__("os").getcwd())]'),  # read as a literal or not at all, never run
        ("pythonic", '[get_weather("Köln")]'),
        ("mistral", "[TOOL_CALLS]" + "[" * 5000 + "]" * 5000),  # nested past Python's limit: text, not a crash
        ("pythonic", "[get_weather(city=" + "[" * 5000 + "]" * 5000 + ")]"),
    ],
)
def test_a_malformed_undeclared_or_unfinished_call_is_content(format: str, reply: str) -> None:
    assert parse_in_pieces(format, reply, 3, DECLARED) == (reply, [])


def test_text_alone_is_content_in_every_format() -> None:
    for format in REPLIES:
        assert parse_in_pieces(format, "It is sunny.", 2, DECLARED) == ("It is sunny.", [])


TEMPLATES = {
    "qwen3_coder": "{% for t in tools %}{{ t }}{% endfor %}<tool_call>\n<function=example_function_name>\n<parameter=example>\n",
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
    "deepseek_v3": "{% if tools %}{{ tools }}{% endif %}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",
    "pythonic": "{% if tools %}Reply [func_name1(params_name1=params_value1), func_name2(params)]{{ tools }}{% endif %}",
}


@pytest.mark.parametrize("format", list(TEMPLATES))
def test_the_format_is_read_from_the_template(format: str) -> None:
    assert tool_call_format(TEMPLATES[format]) == format


def walks(grammar: str, count: int) -> list[str]:
    """Replies of random (deterministic) walks through the grammar's allowed bytes, each ended at
    the first place the grammar allows an end; a walk still going after 3,000 bytes (a list of
    calls the walk kept adding to) is left out, and most walks end."""
    tokenizer = byte_tokenizer()
    assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == ""
    replies = []
    for walk in range(count):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        reply = bytearray()
        while not matcher.is_stopped():
            mask = matcher.compute_bitmask()
            allowed = [t for t in range(257) if mask[t // 8] >> (t % 8) & 1]
            if 256 in allowed or len(reply) > 3000:
                break
            token = allowed[(walk * 7919 + len(reply) * 104729) % len(allowed)]
            if len(reply) > 300 and ord("]") in allowed:  # past a few calls, close the list they are in
                token = ord("]")
            assert matcher.consume_token(token)
            reply.append(token)
        if len(reply) <= 3000:
            assert matcher.is_accepting(), reply
            replies.append(reply.decode())
    assert len(replies) > count // 2
    return replies


@pytest.mark.parametrize(("format", "parallel"), [("llama3_json", False)] + [(f, p) for f in ("hermes", *REPLIES) for p in (True, False)])
def test_the_forced_grammar_allows_only_calls_of_the_tools_with_valid_arguments(format: str, parallel: bool) -> None:
    grammar = forced_call_grammar(format, TOOLS, parallel, JSON_OPTIONS)  # type: ignore[arg-type]
    for reply in walks(grammar, 24):
        content, calls = parse_in_pieces(format, reply, 5, DECLARED)
        assert content == "" and calls, reply
        assert len(calls) == 1 or parallel
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), DECLARED[call.name])
        if format in STREAMED:  # the same calls, their arguments as the model wrote them
            streamed_content, streamed = parse_in_pieces(format, reply, 3, DECLARED, stream_arguments=True)
            assert streamed_content == "" and [(c.name, json.loads(c.arguments)) for c in streamed] == [
                (c.name, json.loads(c.arguments)) for c in calls
            ]


def accepts(grammar: str, reply: str) -> bool:
    matcher = llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0)
    return matcher.consume_tokens(list(reply.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("format", list(REPLIES))
def test_the_forced_grammar_accepts_the_formats_own_calls_and_no_text(format: str) -> None:
    grammar = forced_call_grammar(format, TOOLS, True, {"whitespace_flexible": False, "whitespace_pattern": " ?"})  # type: ignore[arg-type]
    assert accepts(grammar, REPLIES[format].removeprefix(CONTENT[format]))
    assert not accepts(grammar, "It is sunny.")


def test_what_a_format_cannot_force_is_refused() -> None:
    dashed = FunctionTool("f", None, {"type": "object", "properties": {"not-a-name": {"type": "string"}}})
    with pytest.raises(ValueError, match="no Python name"):
        forced_call_grammar("pythonic", [dashed], False, JSON_OPTIONS)
    patterned = FunctionTool("f", None, {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}})
    with pytest.raises(ValueError, match="pattern"):
        forced_call_grammar("qwen3_coder", [patterned], False, JSON_OPTIONS)
