"""Tool calls in each format beyond Hermes and Llama 3.1 JSON, through the real app (`python -m
service` on small Llama folders, each with a chat template of that family: tests/service/templates/)
and the official openai client: Mistral's [TOOL_CALLS] and DeepSeek V3's markers as special tokens
of the vocabulary (written by the model as those tokens, kept in the reply's text for the parser),
Qwen3-Coder's XML and the pythonic list as text. Forced calls, streamed and not, whose arguments
validate; Mistral's 9-character call ids; the call sent back with its result (the template renders
it); automatic tool choice answering; the Responses API on one of them."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from loading.hf_tokenizers import FastTextTokenizer
from tests.helpers import python_m_service
from tests.hf_folders import build_llama_folder
from tests.service.test_structured_outputs import joined_call_deltas

TEMPLATES = Path(__file__).parent / "templates"
# Each format's model: its template, and the markers its vocabulary holds as special tokens.
FORMATS: dict[str, tuple[str, list[str]]] = {
    "mistral": ("mistral.jinja", ["[TOOL_CALLS]", "[ARGS]"]),
    "deepseek_v3": (
        "deepseek_v3.jinja",
        ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"],
    ),
    "qwen3_coder": ("qwen3_coder.jinja", []),
    "pythonic": ("llama32_pythonic.jinja", []),
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Verona?"}]


def build_folder(path: Path, template: str, special: list[str]) -> Path:
    """A small Llama folder whose chat template is `template` and whose vocabulary has `special` as special tokens."""
    folder = build_llama_folder(path, max_positions=2048)  # room for the tools in the prompt
    if special:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.add_special_tokens(special)
        tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    return {name: build_folder(root / name, template, special) for name, (template, special) in FORMATS.items()}


@pytest.fixture(scope="module")
def client(folders: dict[str, Path]) -> Iterator[openai.OpenAI]:
    with python_m_service(folders) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_each_folders_format_is_read_from_its_template_and_its_special_markers_are_kept(folders: dict[str, Path]) -> None:
    for name, (_, special) in FORMATS.items():
        tokenizer = FastTextTokenizer(folders[name] / "tokenizer.json")
        assert set(tokenizer.tool_markers) == set(special), name
        for marker, token_id in tokenizer.tool_markers.items():
            assert token_id in tokenizer.special_ids and tokenizer.piece_bytes(token_id) == marker.encode()


def assert_valid(calls: list[Any], names: set[str], format: str) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function" and call.function.name in names
        assert len(call.id) == 9 and call.id.isalnum() if format == "mistral" else call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(
            arguments, WEATHER_PARAMETERS if call.function.name == "get_weather" else {"type": "object", "maxProperties": 0}
        )


@pytest.mark.parametrize("format", list(FORMATS))
def test_forced_calls_validate_streamed_or_not_and_go_back_with_their_result(client: openai.OpenAI, format: str) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, names in ((named, {"get_weather"}), ("required", {"get_weather", "get_time"})):
        answer = client.chat.completions.create(
            model=format, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=300, seed=3
        )
        choice = answer.choices[0]
        assert choice.finish_reason == ("stop" if tool_choice is named else "tool_calls"), choice
        calls = choice.message.tool_calls or []
        assert_valid(calls, names, format)
        stream = client.chat.completions.create(
            model=format, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=300, stream=True
        )
        assert_valid(joined_call_deltas([d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]), names, format)
    call = calls[0]
    history: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
    ]
    after = client.chat.completions.create(model=format, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert after.choices[0].message.tool_calls is None and after.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("format", list(FORMATS))
def test_automatic_tool_choice_answers_text_or_valid_calls(client: openai.OpenAI, format: str) -> None:
    answer = client.chat.completions.create(model=format, messages=QUESTION, tools=TOOLS, max_tokens=40, seed=5)
    choice = answer.choices[0]
    if choice.message.tool_calls:  # random weights: a call is unlikely, but one that comes must parse
        assert choice.finish_reason == "tool_calls"
        assert_valid(choice.message.tool_calls, {"get_weather", "get_time"}, format)
    else:
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


def test_the_responses_api_forces_a_call_in_mistrals_format(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
    response = client.responses.create(
        model="mistral", input="Weather in Verona?", tools=[tool], tool_choice="required", parallel_tool_calls=False, max_output_tokens=300
    )
    [call] = response.output
    assert call.type == "function_call" and len(call.call_id) == 9
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
