"""Chat completions, n choices, stream_options, streamed tool calls and tokenize/detokenize in the
HTTP layer, over fake models that answer from what they were sent."""

import json
from collections.abc import AsyncGenerator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_api
from service.config import ServiceConfig
from service.protocol import ChatMessage, Chunk, GenerateRequest, Refusal, TokenizeRequest, Tokens, ToolCallPiece
from tests.helpers import backends_for


class EchoModel:
    """Streams "<seed>:" then the last message (or the prompt) word by word; records requests."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        self.requests.append(request)
        if request.messages is not None and request.messages[0].content == "no template":
            yield Refusal("invalid", "the model has no chat template; use /v1/completions", "messages")
            return
        text = request.messages[-1].content if request.messages is not None else request.text
        words = [f"{request.sampling.seed}:", *(" " + w for w in text.split())]
        yield Chunk("", prompt_tokens=5)
        for i, word in enumerate(words):
            yield Chunk(word, "stop" if i == len(words) - 1 else None, prompt_tokens=5, completion_tokens=i + 1)

    async def tokenize(self, request: TokenizeRequest) -> Tokens:
        text = request.text if request.messages is None else "|".join(m.content or "" for m in request.messages)
        ids = tuple(ord(c) for c in text) + ((1,) if request.add_special_tokens and request.messages is None else ())
        return Tokens(ids, tuple(chr(i) for i in ids), 256)

    async def detokenize(self, ids: tuple[int, ...]) -> str | Refusal:
        return "".join(chr(i) for i in ids)

    async def ready(self) -> bool:
        return True


@pytest.fixture
def api() -> tuple[TestClient, EchoModel]:
    model = EchoModel()
    return TestClient(create_api(ServiceConfig(), backends_for(ServiceConfig(), model))), model


def events(http: TestClient, path: str, body: dict[str, object]) -> list[dict[str, object] | str]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "good night"}]}]


def test_a_chat_completion_answers_the_messages_as_openai_shapes_it(api: tuple[TestClient, EchoModel]) -> None:
    http, model = api
    answer = http.post("/v1/chat/completions", json={"messages": MESSAGES, "seed": 7, "max_completion_tokens": 9}).json()
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "7: good night"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    (sent,) = model.requests
    assert sent.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "good night")) and sent.max_tokens == 9


def test_a_streamed_chat_sends_the_role_then_content_then_the_finish_and_equals_the_unstreamed(api: tuple[TestClient, EchoModel]) -> None:
    http, _ = api
    body = {"messages": MESSAGES, "seed": 3, "stream": True, "stream_options": {"include_usage": True}}
    frames = events(http, "/v1/chat/completions", body)
    assert frames[-1] == "[DONE]"
    usage, choices = frames[-2], [f["choices"][0] for f in frames[:-2]]  # type: ignore[index]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}  # type: ignore[index]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["finish_reason"] is None for c in choices[:-1]) and choices[-1] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    streamed = "".join(c["delta"].get("content", "") for c in choices)
    unstreamed = http.post("/v1/chat/completions", json={"messages": MESSAGES, "seed": 3}).json()["choices"][0]["message"]["content"]
    assert streamed == unstreamed == "3: good night"
    assert all(f["object"] == "chat.completion.chunk" for f in frames[:-1])  # type: ignore[index]


def test_n_gives_independent_choices_each_with_its_own_seed(api: tuple[TestClient, EchoModel]) -> None:
    http, model = api
    answer = http.post("/v1/completions", json={"prompt": "to be", "n": 3, "seed": 10, "temperature": 1.0}).json()
    assert [c["text"] for c in answer["choices"]] == ["10: to be", "11: to be", "12: to be"]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}  # the prompt once
    frames = events(http, "/v1/chat/completions", {"messages": MESSAGES, "n": 2, "seed": 0, "stream": True})
    texts = {0: "", 1: ""}
    for frame in frames[:-1]:
        choice = frame["choices"][0]  # type: ignore[index]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: "0: good night", 1: "1: good night"}
    assert len(model.requests) == 5


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def NAMED(name: str) -> dict[str, object]:  # noqa: N802 (reads as the value it builds)
    return {"type": "function", "function": {"name": name}}


def CALL(arguments: str) -> dict[str, object]:  # noqa: N802
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.0.function"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL, TOOL]}, "tools"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": NAMED("nowhere")}, "tool_choice"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "4"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [CALL("[1]")]}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [CALL("[" * 100_000 + "]" * 100_000)]}]}, "messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
            "response_format.json_schema.json_schema",
        ),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs
        ("/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/v1/completions", {"prompt": "x", "n": 9}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "no template"}]}, "messages"),
    ],
)
def test_what_the_server_cannot_do_is_a_400_naming_the_field(
    api: tuple[TestClient, EchoModel], path: str, body: dict[str, object], param: str
) -> None:
    http, _ = api
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_tokenize_and_detokenize_as_vllm_answers_them(api: tuple[TestClient, EchoModel]) -> None:
    http, _ = api
    tokens = http.post("/tokenize", json={"prompt": "ab"}).json()
    assert tokens == {"count": 3, "max_model_len": 256, "tokens": [97, 98, 1]}
    plain = http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain == {"count": 2, "max_model_len": 256, "tokens": [97, 98], "token_strs": ["a", "b"]}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}).json()
    assert chat["tokens"] == [97, 124, 98]
    assert http.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert http.post("/tokenize", json={"prompt": "a", "model": "nope"}).status_code == 404
    assert http.post("/tokenize", json={}).status_code == 400


def test_penalties_bias_min_tokens_ignore_eos_and_speculation_reach_the_model(api: tuple[TestClient, EchoModel]) -> None:
    http, model = api
    penalties = {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2}
    penalties |= {"min_tokens": 2, "ignore_eos": True, "logit_bias": {"5": -100}, "speculative_decoding": False}
    assert http.post("/v1/completions", json={"prompt": "x", **penalties}).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": MESSAGES, **penalties}).status_code == 200
    for request in model.requests:
        sampling = request.sampling
        assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.5, 1.2)
        assert (request.min_tokens, request.ignore_eos, request.sampling.logit_bias) == (2, True, ((5, -100.0),))
        assert not request.speculate
    assert http.post("/v1/completions", json={"prompt": "x", "speculative_decoding": "no"}).status_code == 400  # a boolean
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200 and model.requests[-1].speculate  # on by default


class CallingModel:
    """Calls the request's named function with {"city": "Köln"}, its arguments written in two pieces after its name."""

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        yield Chunk("", prompt_tokens=4)
        pieces = (ToolCallPiece(0, "", "call_a", request.tool_name), ToolCallPiece(0, '{"city": '), ToolCallPiece(0, '"Köln"}'))
        for i, piece in enumerate(pieces):
            yield Chunk("", "stop" if i == len(pieces) - 1 else None, tool_calls=(piece,), prompt_tokens=4, completion_tokens=i + 1)

    async def ready(self) -> bool:
        return True


def test_a_forced_call_streams_its_name_then_its_arguments_in_pieces_through_the_openai_client() -> None:
    config = ServiceConfig()
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    with TestClient(create_api(config, backends_for(config, CallingModel()))) as http:  # type: ignore[arg-type]
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        messages: Any = [{"role": "user", "content": "Weather?"}]
        stream = client.chat.completions.create(
            messages=messages, model="transformer-shakespeare", tools=tools, tool_choice=choice, stream=True
        )
        chunks = [c for c in stream if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert [(d.index, d.id, d.type, d.function.name, d.function.arguments) for d in deltas] == [
            (0, "call_a", "function", "get_weather", ""),
            (0, None, None, None, '{"city": '),
            (0, None, None, None, '"Köln"}'),
        ]
        assert chunks[-1].choices[0].finish_reason == "stop"  # a named function's call ends with "stop", as OpenAI's
        whole = client.chat.completions.create(messages=messages, model="transformer-shakespeare", tools=tools, tool_choice=choice)
        [call] = whole.choices[0].message.tool_calls or []
        assert (call.id, call.function.name, call.function.arguments) == ("call_a", "get_weather", '{"city": "Köln"}')


class HalfCharacterModel(EchoModel):
    """Answers "é!" whose first token is half of "é" (no text yet), with an empty chunk before any
    token (nothing made yet) and one without text in the middle."""

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        yield Chunk("", prompt_tokens=5)
        yield Chunk("", prompt_tokens=5, completion_tokens=1)
        yield Chunk("é", prompt_tokens=5, completion_tokens=2)
        yield Chunk("", prompt_tokens=5, completion_tokens=3)
        yield Chunk("!", "stop", prompt_tokens=5, completion_tokens=4)


def test_a_streamed_completion_sends_its_first_tokens_when_made_even_without_text() -> None:
    """The first frame comes with the first tokens, text or not (a client's time to first token);
    a chunk without text later sends nothing, and nothing goes out before a token is made."""
    http = TestClient(create_api(ServiceConfig(), backends_for(ServiceConfig(), HalfCharacterModel())))
    frames = events(http, "/v1/completions", {"prompt": "x", "stream": True})
    assert frames[-1] == "[DONE]"
    assert [(f["choices"][0]["text"], f["choices"][0]["finish_reason"]) for f in frames[:-1]] == [("", None), ("é", None), ("!", "stop")]  # type: ignore[index, call-overload]
    answer = http.post("/v1/completions", json={"prompt": "x"}).json()
    assert answer["choices"][0]["text"] == "é!" and answer["usage"]["completion_tokens"] == 4
