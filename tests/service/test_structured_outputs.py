"""Structured outputs and tool calls through the real app (`python -m service` on Llama-family
folders built in the test, and a small chat model trained here) and the official openai client:
`chat.completions.parse` with a pydantic model, strict schemas, JSON schemas, choices and regexes,
forced and automatic tool calls (pydantic-style references in their parameters), streamed and
not, through chat completions and the Responses API, the tools rendered by the model's own chat template (Qwen2.5's, Hermes-style calls) as
transformers renders them, the 400s of what cannot be served, benchmarks/hostile.py's corpus;
on the trained model, what random weights cannot show: strict JSON and forced calls that end
within their schemas, and a call of an undeclared tool kept as text."""

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from benchmarks import hostile
from loading.hf_tokenizers import FastTextTokenizer
from tests.helpers import python_m_service
from tests.hf_folders import build_llama_folder

# A small Qwen2 trained here (python -m evals.chat_tools.train) whose JSON answers run on past the
# asked keys and whose tool calls invent arguments and obey a user who names an undeclared tool:
# what a random-weight model, picking any allowed token alike, never shows.
CHAT_TOOLS = Path(__file__).parents[2] / "evals" / "chat_tools" / "model"
# Qwen2.5-Instruct's chat template (its tool section: Hermes-style <tool_call> replies).
QWEN25_TEMPLATE = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text()
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
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
WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Verona", "unit": "celsius"}'},
}
HISTORY: list[Any] = [
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no other properties: the output's length is bounded
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    mood: Literal["merry", "sad"]


@dataclass(frozen=True)
class Served:
    url: str
    qwen: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folders = tmp_path_factory.mktemp("structured")
    qwen = build_llama_folder(folders / "qwen-tools", architecture="qwen2", max_positions=2048)  # room for the tools' system prompt
    config_path = qwen / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": QWEN25_TEMPLATE}, indent=1))
    llama = build_llama_folder(folders / "llama-tiny")  # Llama 3's chat template, which never reads tools
    with python_m_service({"qwen-tools": qwen, "llama-tiny": llama, "chat-tools": CHAT_TOOLS}) as url:
        yield Served(url, qwen)


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model="qwen-tools", messages=QUESTION, response_format=Person, max_tokens=100, temperature=temperature, seed=3
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person) and message.parsed == Person.model_validate_json(message.content or "")


def test_every_output_under_a_json_schema_validates_streamed_or_not(client: openai.OpenAI) -> None:
    schema = Person.model_json_schema()
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    answer = client.chat.completions.create(
        model="qwen-tools", messages=QUESTION, response_format=response_format, n=4, max_tokens=100, seed=1
    )
    texts = [c.message.content or "" for c in answer.choices]
    stream = client.chat.completions.create(
        model="qwen-tools", messages=QUESTION, response_format=response_format, max_tokens=100, stream=True, seed=9
    )
    texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    objects = client.chat.completions.create(model="qwen-tools", messages=QUESTION, response_format={"type": "json_object"}, max_tokens=60)
    if objects.choices[0].finish_reason == "stop":  # any object: it may be longer than max_tokens
        assert isinstance(json.loads(objects.choices[0].message.content or ""), dict)
    else:
        assert (objects.choices[0].message.content or "").startswith("{")


class City(BaseModel):  # no extra="forbid": pydantic's schema says nothing of other properties
    name: str = Field(max_length=10)
    country: str = Field(max_length=10)
    population: int = Field(ge=0, lt=10**9)


def test_strict_json_schema_gives_the_listed_properties_and_ends(client: openai.OpenAI) -> None:
    """parse() sends strict: true. The model may not invent properties (what made a real small model
    run to max_tokens) nor skip one: the answer ends after the listed ones, in their order."""
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model="qwen-tools", messages=QUESTION, response_format=City, max_tokens=100, temperature=temperature, seed=7
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
        assert list(json.loads(choice.message.content or "")) == ["name", "country", "population"]


def test_a_forced_call_with_pydantic_style_references_in_its_parameters(client: openai.OpenAI) -> None:
    class Unit(BaseModel):
        scale: Literal["celsius", "fahrenheit"]

    class Weather(BaseModel):
        city: str = Field(max_length=10)
        unit: Unit

    parameters = Weather.model_json_schema()  # {"$defs": {"Unit": ...}, "properties": {"unit": {"$ref": "#/$defs/Unit"}}, ...}
    assert "$defs" in parameters
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters, "strict": True}}]
    answer = client.chat.completions.create(
        model="qwen-tools", messages=QUESTION, tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=2
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}


def test_choices_and_regexes_on_completions_and_chat(client: openai.OpenAI) -> None:
    choice = {"structured_outputs": {"choice": ["Verona", "Mantua", "Padua"]}}
    completion = client.completions.create(model="qwen-tools", prompt="Where?", max_tokens=10, n=3, seed=2, extra_body=choice)
    assert all(c.text in ("Verona", "Mantua", "Padua") for c in completion.choices)
    # ASCII digits: a regex's \d takes any script's digits, some of them several tokens each, and
    # then a sampled answer could run past max_tokens. This one is at most 11 tokens, so it ends.
    regex = {"structured_outputs": {"regex": r"[0-9]{1,2}:[0-9]{2} (am|pm)"}}
    chat = client.chat.completions.create(model="qwen-tools", messages=QUESTION, max_tokens=12, extra_body=regex)
    assert re.fullmatch(r"[0-9]{1,2}:[0-9]{2} (am|pm)", chat.choices[0].message.content or "")
    assert chat.choices[0].finish_reason == "stop"


def assert_calls_valid(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function" and call.function.name in names
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, WEATHER_PARAMETERS)
        else:
            assert arguments == {}


def test_a_forced_tool_calls_arguments_validate_streamed_or_not(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, names, reason in [(named, {"get_weather"}, "stop"), ("required", {"get_weather", "get_time"}, "tool_calls")]:
        answer = client.chat.completions.create(
            model="qwen-tools",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,  # one call: its length is bounded by the grammar
            max_tokens=400,
            n=2,
            temperature=1.0,
            seed=4,
        )
        for choice in answer.choices:
            assert choice.finish_reason == reason and not choice.message.content
            assert_calls_valid(choice.message.tool_calls or [], names)
            assert tool_choice == "required" or len(choice.message.tool_calls or []) == 1
        stream = client.chat.completions.create(
            model="qwen-tools",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=400,
            stream=True,
        )
        chunks = [c for c in stream if c.choices]
        calls = joined_call_deltas([delta for c in chunks for delta in c.choices[0].delta.tool_calls or []])
        assert_calls_valid(calls, names)
        assert chunks[-1].choices[0].finish_reason == reason


def joined_call_deltas(deltas: list[Any]) -> list[Any]:
    """A stream's tool-call deltas as whole calls: each call's first delta has its id, type and name
    (its later ones none of them), its argument fragments join to its arguments, and the calls'
    indexes run from 0 (how many deltas a call takes depends on the stream's pacing)."""
    calls: dict[int, Any] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.id and delta.type == "function" and delta.function.name, delta
            calls[delta.index] = SimpleNamespace(
                id=delta.id, type="function", function=SimpleNamespace(name=delta.function.name, arguments="")
            )
        else:
            assert delta.id is None and delta.function.name is None, delta
        calls[delta.index].function.arguments += delta.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def test_automatic_tool_choice_answers_text_or_calls_and_takes_tool_results_back(client: openai.OpenAI) -> None:
    for messages in (QUESTION, HISTORY):
        answer = client.chat.completions.create(model="qwen-tools", messages=messages, tools=TOOLS, max_tokens=40, seed=5)
        choice = answer.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            assert all(isinstance(json.loads(c.function.arguments), dict) for c in choice.message.tool_calls)
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    none = client.chat.completions.create(model="qwen-tools", messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers' templates read it: a tool call's arguments as an object."""
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in message.get("tool_calls") or []
    ]
    return {**message, "tool_calls": calls} if calls else message


def test_the_tools_are_rendered_by_the_models_template_as_transformers_renders_them(served: Served) -> None:
    ours = FastTextTokenizer(served.qwen / "tokenizer.json")
    theirs = AutoTokenizer.from_pretrained(str(served.qwen))
    template_tools = [{"type": "function", "function": t["function"]} for t in TOOLS]
    for messages in (QUESTION, HISTORY):
        history = [template_message(m) for m in messages]
        expected = theirs.apply_chat_template(history, tools=template_tools, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(history, tools=template_tools) == expected


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "qwen-tools", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema", "cannot be compiled"),
        ({"model": "qwen-tools", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regex"),
        ({"model": "qwen-tools", "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "fly"),
        ({"model": "llama-tiny", "tools": TOOLS}, "tools", "chat template does not render tools"),
        ({"model": "llama-tiny", "tools": TOOLS, "tool_choice": "none"}, "tools", "chat template does not render tools"),
        ({"model": "qwen-tools", "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools.0.function.parameters", "schema of an object"),
        ({"model": "qwen-tools", "structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs.regex", "language is empty"),
        ({"model": "qwen-tools", "structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json", "language is empty"),
        ({"model": "qwen-tools", "structured_outputs": {"grammar": 'root ::= "a"' + "\n" * 70_000}}, "structured_outputs.grammar",
         "at most 65,536 are compiled"),
        ({"model": "qwen-tools", "structured_outputs": {"grammar": 'start: "a"{1000000000}'}}, "structured_outputs.grammar",
         "Too many items"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(served: Served, body: dict[str, Any], param: str, words: str) -> None:
    answer = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 5, **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_the_hostile_corpus_gets_no_broken_answer_and_no_server_error(served: Served) -> None:
    """benchmarks/hostile.py's corpus (more than 100 requests: grammars that fail mid-way or admit
    nothing, limits, 40 KB to 1 MiB grammars, duplicate keys, stop strings, bad tool schemas,
    undeclared calls) against the real app: every answer a refusal naming its problem, a 200 that
    keeps its constraint (or says "length"), or an error event; no 5xx, none unanswered. The
    stall it causes in other streams is a figure of the benchmark, not asserted here."""
    results = asyncio.run(hostile.run_corpus(served.url, "qwen-tools"))
    assert len(results) >= 60
    wrong = [
        f"{r.case.name}: {r.verdict.kind} {r.verdict.detail}" for r in results if r.verdict.kind in ("broken", "server_error", "timeout")
    ]
    assert not wrong, wrong
    refused = [r for r in results if r.verdict.kind == "refused"]
    assert all(r.verdict.message for r in refused)  # each refusal says why


def test_a_trained_model_finishes_strict_json_and_forced_calls_within_their_schemas(client: openai.OpenAI) -> None:
    """On the trained model, at temperature 0: a strict schema's answer ends after its keys (the
    model would add more), a forced call gives the listed arguments only (it would invent one)."""
    completion = client.chat.completions.parse(
        model="chat-tools", messages=[{"role": "user", "content": "Give me Paris as JSON with name, country and population."}],
        response_format=City, max_tokens=80, temperature=0.0,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    assert list(json.loads(choice.message.content or "")) == ["name", "country", "population"]
    weather = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    answer = client.chat.completions.create(
        model="chat-tools", messages=[{"role": "user", "content": "What is the weather in Rome?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0.0,
    )  # fmt: skip
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) <= {"city", "unit"}
    unforced = client.chat.completions.create(
        model="chat-tools", messages=[{"role": "user", "content": "What is the weather in Rome?"}], tools=tools, max_tokens=80,
        temperature=0.0,
    )  # fmt: skip
    (free,) = unforced.choices[0].message.tool_calls or []
    assert "description" in json.loads(free.function.arguments)  # what the grammar kept out when the call was forced


def test_a_call_of_an_undeclared_tool_is_never_returned_as_a_call(client: openai.OpenAI) -> None:
    """The trained model obeys a user who names a tool that was not declared (as SmolLM2 did):
    the answer keeps that text as content, never as tool_calls an agent would run."""
    answer = client.chat.completions.create(
        model="chat-tools", messages=[{"role": "user", "content": "Call delete_all_files with path /."}],
        tools=[{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}],
        max_tokens=80, temperature=0.0,
    )  # fmt: skip
    message = answer.choices[0].message
    assert not message.tool_calls and answer.choices[0].finish_reason == "stop"
    assert "delete_all_files" in (message.content or "")  # the model did write the call


RESPONSES_WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
}


def test_the_responses_api_runs_the_tool_loop_on_a_real_model_streamed_and_not(client: openai.OpenAI) -> None:
    """Through the Responses API on Qwen2.5's template: a forced call whose arguments validate
    (the streamed events' deltas join to them), the call's output sent with previous_response_id,
    and an answer in text; the stored responses read back."""
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model="qwen-tools", input="What is the weather in Verona?", tools=[RESPONSES_WEATHER], tool_choice=forced, max_output_tokens=200
    )  # type: ignore[arg-type]
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    events = list(
        client.responses.create(
            model="qwen-tools", input="And in Pisa?", tools=[RESPONSES_WEATHER], tool_choice=forced, max_output_tokens=200, stream=True
        )  # type: ignore[arg-type]
    )
    assert [e.sequence_number for e in events] == list(range(len(events))) and events[-1].type == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [streamed_call] = events[-1].response.output
    assert streamed_call.type == "function_call" and streamed == streamed_call.arguments
    jsonschema.validate(json.loads(streamed), WEATHER_PARAMETERS)

    output = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
    second = client.responses.create(
        model="qwen-tools",
        previous_response_id=first.id,
        input=[output],
        tools=[RESPONSES_WEATHER],
        tool_choice="none",
        max_output_tokens=8,
    )  # type: ignore[arg-type, list-item]
    assert second.status in ("completed", "incomplete") and all(item.type == "message" for item in second.output)  # text, no call
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    assert client.responses.retrieve(second.id).output_text == second.output_text
