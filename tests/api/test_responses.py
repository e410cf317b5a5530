"""The Responses API (`/v1/responses`) through the official openai client, in-process over a fake
model that answers a chat (tests/service/ serves it from a real model): text and function calls
as output items, streamed as typed events in order, the tool loop with previous_response_id, the
store (per API key, bounded, expiring), and every refusal a 400 naming its field."""

import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_api
from service.api.response_store import ResponseStore
from service.config import ServiceConfig
from service.protocol import Chunk, GenerateRequest, Refusal, ToolCall, ToolCallPiece
from tests.helpers import backends_for

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
}
ARGUMENTS = '{"city": "Köln"}'


class AgentModel:
    """A chat's answer: with tools and the last message not a tool's, "Let me look." then a call of
    the first tool given whole (under auto), or the forced call in three pieces; after a tool's
    message, "It is <its output>."; otherwise the last message word by word (cut at max_tokens,
    finishing "length"). Records the requests."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        self.requests.append(request)
        assert request.messages is not None
        last = request.messages[-1]
        yield Chunk("", prompt_tokens=7)
        if request.tools and last.role != "tool":
            name = request.tool_name or request.tools[0].name
            if request.tool_choice == "auto":  # a call given whole once it parses
                yield Chunk("Let me look.", prompt_tokens=7, completion_tokens=3)
                yield Chunk("\n", "stop", tool_calls=(ToolCallPiece(0, ARGUMENTS, "call_1", name),), prompt_tokens=7, completion_tokens=12)
                return
            pieces = (ToolCallPiece(0, "", "call_1", name), ToolCallPiece(0, ARGUMENTS[:9]), ToolCallPiece(0, ARGUMENTS[9:]))
            for i, piece in enumerate(pieces):  # a forced call, as it is written
                yield Chunk("", "stop" if i == len(pieces) - 1 else None, tool_calls=(piece,), prompt_tokens=7, completion_tokens=4 * i + 4)
            return
        words = (f"It is {last.content}." if last.role == "tool" else last.content or "").split(" ")
        limit = min(len(words), request.max_tokens or len(words))
        for i in range(limit):
            end = ("stop" if limit == len(words) else "length") if i == limit - 1 else None
            yield Chunk(("" if i == 0 else " ") + words[i], end, prompt_tokens=7, completion_tokens=i + 1)


@pytest.fixture
def served() -> Iterator[tuple[openai.OpenAI, AgentModel]]:
    model = AgentModel()
    app = create_api(ServiceConfig(), backends_for(ServiceConfig(), model))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http), model


def test_a_text_answer_is_one_message_item_with_usage(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, model = served
    response = client.responses.create(model="transformer-shakespeare", input="All is well", instructions="Be brief.")
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "All is well"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        7,
        3,
        10,
    )
    assert response.instructions == "Be brief." and response.store is True
    [request] = model.requests
    assert [(m.role, m.content) for m in request.messages or ()] == [("system", "Be brief."), ("user", "All is well")]


def test_a_streamed_answer_sends_the_typed_events_in_order(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, _ = served
    events = list(client.responses.create(input="All is well", stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == "All is well"
    assert client.responses.retrieve(final.id).output_text == "All is well"  # stored as it was streamed


def test_the_tool_loop_continues_a_stored_response(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, model = served
    first = client.responses.create(input="Weather in Köln?", tools=[WEATHER], instructions="Use tools.")  # type: ignore[list-item]
    message, call = first.output
    assert message.type == "message" and first.output_text == "Let me look."
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id == "call_1"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(previous_response_id=first.id, input=[output], tools=[WEATHER])  # type: ignore[list-item]
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    conversation = model.requests[-1].messages or ()
    # The earlier instructions are not carried over (as OpenAI's); the earlier turn is.
    assert [m.role for m in conversation] == ["user", "assistant", "tool"]
    assert conversation[1].content == "Let me look." and conversation[1].tool_calls == (ToolCall("call_1", "get_weather", ARGUMENTS),)
    assert conversation[2].tool_call_id == "call_1" and conversation[2].content == "sunny"


def test_the_loop_with_the_calls_sent_back_as_input_items(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, model = served
    first = client.responses.create(input="Weather in Köln?", tools=[WEATHER], tool_choice="required", store=False)  # type: ignore[list-item]
    [call] = first.output
    assert call.type == "function_call"
    items: list[Any] = [
        {"role": "user", "content": "Weather in Köln?"},
        call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    assert client.responses.create(input=items, tools=[WEATHER]).output_text == "It is sunny."  # type: ignore[list-item]
    assert [m.role for m in model.requests[-1].messages or ()] == ["user", "assistant", "tool"]


def test_a_streamed_call_sends_its_name_then_arguments_that_join_to_the_call(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, _ = served
    events = list(
        client.responses.create(input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, stream=True)
    )  # type: ignore[list-item]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    final = events[-1].response.output[0]
    assert len(deltas) == 2 and "".join(deltas) == done.arguments == final.arguments == ARGUMENTS  # as it was written
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_text_format_and_sampling_reach_the_engine(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, model = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    client.responses.create(input="x", text=text, temperature=0.5, top_p=0.9, max_output_tokens=5)  # type: ignore[arg-type]
    request = model.requests[-1]
    assert request.structured is not None and json.loads(request.structured.spec) == schema and request.structured.strict
    assert (request.sampling.temperature, request.sampling.top_p, request.max_tokens) == (0.5, 0.9, 5)


def test_the_length_cut_makes_an_incomplete_response(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, _ = served
    response = client.responses.create(input="one two three four", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "one two"


def test_stored_responses_are_read_and_deleted_and_unstored_ones_are_not_found(served: tuple[openai.OpenAI, AgentModel]) -> None:
    client, _ = served
    kept = client.responses.create(input="kept")
    assert client.responses.retrieve(kept.id).output_text == "kept"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unstored = client.responses.create(input="not kept", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(input="on", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_another_keys_response_does_not_exist_for_it() -> None:
    config = ServiceConfig(api_keys=["key-a", "key-b"])
    with TestClient(create_api(config, backends_for(config, AgentModel()))) as http:
        a, b = (openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http) for key in ("key-a", "key-b"))
        response = a.responses.create(input="mine")
        assert a.responses.retrieve(response.id).output_text == "mine"
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(input="yours?", previous_response_id=response.id)
        assert a.responses.retrieve(response.id).output_text == "mine"  # b's delete changed nothing


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "has space"}]}, "tools.0"),
        ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools.0.parameters"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100_000 + "]" * 100_000}]},
            "input.0.arguments",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_the_field(
    served: tuple[openai.OpenAI, AgentModel], fields: dict[str, Any], param: str
) -> None:
    client, model = served
    body = {"input": "Hello", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body=body, cast_to=dict)
    assert str(refused.value.body["param"]).startswith(param), refused.value.body  # type: ignore[index]
    assert not model.requests  # refused before the model


def test_the_store_keeps_a_bounded_number_for_a_bounded_time() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    for i in range(3):
        store.put("me", {"id": f"resp_{i}"}, ())
    assert store.get("me", "resp_0") is None and store.get("me", "resp_1") is not None and len(store) == 2  # the oldest dropped
    assert store.get("someone else", "resp_1") is None and not store.delete("someone else", "resp_1")
    now[0] = 10.5
    store.put("me", {"id": "resp_3"}, ())
    assert store.get("me", "resp_1") is None and store.get("me", "resp_3") is not None  # past its time
    assert store.delete("me", "resp_3") and len(store) == 0
