"""loading/tool_calls.py: the format a chat template asks for, the parser of calls in a reply
(whole, and streamed in pieces cut anywhere; a call of a function not offered is content), and the
grammar that forces a call (random walks through it: tests/model/test_tool_formats.py), their own
$defs and root references included."""

import llguidance
import pytest

from loading.tool_calls import CallPiece, FunctionTool, ToolCallParser, tool_call_format
from loading.tool_formats import ParsedCall, Schemas
from loading.tool_grammars import forced_call_grammar

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False},
)
TIME = FunctionTool("get_time", None, {"type": "object", "properties": {}, "additionalProperties": False})
HERMES_REPLY = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CALLS = [ParsedCall("get_weather", '{"city": "Köln"}'), ParsedCall("get_time", "{}")]
DECLARED: Schemas = {"get_weather": WEATHER.parameters, "get_time": TIME.parameters}
JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": " ?"}


def joined(pieces: list[CallPiece]) -> list[ParsedCall]:
    """Calls from their pieces: a call's first piece names it, its later ones do not, its
    fragments join to its arguments, and the calls' indexes run from 0."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.index not in calls:
            assert piece.name is not None, piece
            calls[piece.index] = [piece.name, ""]
        else:
            assert piece.name is None, piece
        calls[piece.index][1] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [ParsedCall(*calls[i]) for i in sorted(calls)]


def parse_in_pieces(
    format: str, reply: str, size: int, declared: Schemas = DECLARED, stream_arguments: bool = False
) -> tuple[str, list[ParsedCall]]:
    parser = ToolCallParser(format, declared, stream_arguments)  # type: ignore[arg-type]
    content, pieces = "", []
    for start in range(0, len(reply), size):
        text, found = parser.feed(reply[start : start + size])
        content, pieces = content + text, pieces + found
    text, found = parser.close()
    return content + text, joined(pieces + found)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_hermes_calls_are_parsed_however_the_reply_is_cut(size: int) -> None:
    assert parse_in_pieces("hermes", HERMES_REPLY, size) == ("Let me look.\n", CALLS)


def test_text_that_only_starts_like_a_call_is_content() -> None:
    assert parse_in_pieces("hermes", "a <tool b <tool_call", 1) == ("a <tool b <tool_call", [])
    assert parse_in_pieces("hermes", "<tool_call>\nnot json\n</tool_call> after", 4) == ("<tool_call>\nnot json\n</tool_call> after", [])


def test_a_call_whose_closing_tag_never_came_is_still_a_call_when_it_parses() -> None:
    reply = '<tool_call>\n{"name": "get_time", "arguments": {}}'
    assert parse_in_pieces("hermes", reply, 7) == ("", [ParsedCall("get_time", "{}")])
    assert parse_in_pieces("hermes", '<tool_call>\n{"name": "get_ti', 7) == ('<tool_call>\n{"name": "get_ti', [])


def test_llama3_json_replies_are_calls_and_other_replies_content() -> None:
    reply = ' {"name": "get_weather", "parameters": {"city": "Köln"}}; {"name": "get_time", "parameters": {}}'
    assert parse_in_pieces("llama3_json", reply, 3) == ("", CALLS)
    assert parse_in_pieces("llama3_json", "It is sunny.", 3) == ("It is sunny.", [])
    assert parse_in_pieces("llama3_json", "{not json", 3) == ("{not json", [])


def test_a_call_of_a_function_not_offered_is_content_never_a_call() -> None:
    """An agent runs the calls it gets: a reply that writes a call of an undeclared tool (a prompt
    injection asking for it) gives it back as text."""
    injected = '<tool_call>\n{"name": "delete_all_files", "arguments": {"path": "/"}}\n</tool_call>'
    for size in (1, 5, 1000):
        assert parse_in_pieces("hermes", HERMES_REPLY + "\n" + injected, size) == ("Let me look.\n" + injected, CALLS)
    assert parse_in_pieces("hermes", HERMES_REPLY, 3, {"get_time": TIME.parameters}) == (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>\n',
        [ParsedCall("get_time", "{}")],
    )
    reply = '{"name": "delete_all_files", "parameters": {"path": "/"}}'
    assert parse_in_pieces("llama3_json", reply, 4) == (reply, [])
    assert parse_in_pieces("llama3_json", reply + '; {"name": "get_time", "parameters": {}}', 4)[1] == []


FORCED_HERMES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\"{ [", "x": [1, {"y": "]"}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
RAW_CALLS = [ParsedCall("get_weather", '{"city": "a}\\"{ [", "x": [1, {"y": "]"}]}'), ParsedCall("get_time", "{}")]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_forced_calls_stream_their_name_then_their_arguments_as_written(size: int) -> None:
    """The fragments join to the arguments exactly as written (braces and quotes inside strings
    included), however the reply is cut; nothing of it is content."""
    assert parse_in_pieces("hermes", FORCED_HERMES, size, stream_arguments=True) == ("", RAW_CALLS)
    reply = ' {"name": "get_weather", "parameters": {"city": "Köln"}}'
    assert parse_in_pieces("llama3_json", reply, size, stream_arguments=True) == ("", [ParsedCall("get_weather", '{"city": "Köln"}')])


def test_a_forced_calls_name_comes_as_soon_as_it_is_written_and_its_arguments_token_by_token() -> None:
    parser = ToolCallParser("hermes", DECLARED, stream_arguments=True)
    assert parser.feed('<tool_call>\n{"name": "get_wea') == ("", [])
    assert parser.feed('ther"') == ("", [CallPiece(0, "", "get_weather")])
    assert parser.feed(', "arguments": {"ci') == ("", [CallPiece(0, '{"ci')])
    assert parser.feed('ty": "Kö') == ("", [CallPiece(0, 'ty": "Kö')])
    assert parser.feed('ln"}}\n</tool') == ("", [CallPiece(0, 'ln"}')])
    assert parser.feed("_call>") == ("", [])
    assert parser.close() == ("", [])


def test_a_forced_call_cut_short_has_streamed_what_was_written() -> None:
    content, calls = parse_in_pieces("hermes", FORCED_HERMES[:60], 5, stream_arguments=True)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert RAW_CALLS[0].arguments.startswith(calls[0].arguments) and calls[0].arguments != RAW_CALLS[0].arguments


def test_the_format_is_read_from_the_template() -> None:
    assert tool_call_format("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tool_call_format('{% if tools %}{"name": function name, "parameters": dictionary{% endif %}') == "llama3_json"
    assert tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None  # tools never read
    assert tool_call_format("{% for t in tools %}{{ t }}{% endfor %}") is None  # a format this server does not parse
    assert tool_call_format("{% for") is None


def byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer of 256 single-byte tokens and an eos (id 256)."""

    class Bytes:
        def __init__(self) -> None:
            self.tokens = [bytes([i]) for i in range(256)] + [b""]
            self.special_token_ids = [256]
            self.eos_token_id, self.bos_token_id = 256, None

        def __call__(self, text: str | bytes) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()), n_vocab=257)


def test_parallel_calls_follow_one_another() -> None:
    matcher = llguidance.LLMatcher(byte_tokenizer(), forced_call_grammar("hermes", [WEATHER, TIME], True, JSON_OPTIONS), log_level=0)
    calls = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert matcher.consume_tokens(list((calls + "\n" + calls).encode())) and matcher.is_accepting()


def test_a_named_tools_schema_holds_that_tool_alone() -> None:
    grammar = forced_call_grammar("hermes", [TIME], False, JSON_OPTIONS)
    matcher = llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0)
    assert not matcher.consume_tokens(list(b'<tool_call>\n{"name":"get_weather"'))


def accepts(grammar: str, reply: str) -> bool:
    matcher = llguidance.LLMatcher(byte_tokenizer(), grammar, log_level=0)
    return matcher.consume_tokens(list(reply.encode())) and matcher.is_accepting()


def test_references_in_a_tools_parameters_resolve_inside_the_forced_call() -> None:
    """Pydantic writes "#/$defs/..." references, and a recursive schema "#": both relative to the
    parameters, which the forced call's grammar places inside its own schema."""
    unit = {"enum": ["celsius", "fahrenheit"]}
    pydantic_style = FunctionTool(
        "get_weather",
        None,
        {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"], "$defs": {"Unit": unit}},
    )
    tree = FunctionTool("plant", None, {"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False})
    grammar = forced_call_grammar("hermes", [pydantic_style, tree], False, JSON_OPTIONS)
    assert llguidance.LLMatcher.validate_grammar(grammar, byte_tokenizer()) == ""
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    assert accepts(grammar, call.format("get_weather", '{"unit": "celsius"}'))
    assert not accepts(grammar, call.format("get_weather", '{"unit": "kelvin"}'))
    assert accepts(grammar, call.format("plant", '{"child": {"child": {}}}'))
    assert not accepts(grammar, call.format("plant", '{"child": {"leaf": 1}}'))


def test_the_calls_json_takes_the_whitespace_it_is_given() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(forced_call_grammar("hermes", [TIME], False, JSON_OPTIONS), call)
    assert not accepts(forced_call_grammar("hermes", [TIME], False, JSON_OPTIONS), call.replace(": ", ":   "))
    assert not accepts(forced_call_grammar("hermes", [TIME], False, {"whitespace_flexible": False}), call)
