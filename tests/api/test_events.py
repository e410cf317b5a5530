"""Streamed events are written through the models the OpenAPI schema documents: what a route
sets is sent, nothing else, and a frame that does not conform raises rather than going out."""

import json

import pydantic
import pytest

from service.api.schemas import ChatCompletionChunk, CompletionChunk
from service.api.streams import DONE, sse, sse_error

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def data_of(event: str) -> object:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


def test_an_event_holds_what_was_set_and_no_defaults() -> None:
    frame = {**BASE, "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]}
    assert data_of(sse(ChatCompletionChunk, frame)) == frame  # no role, tool_calls or usage added
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with_call = {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}]}
    assert data_of(sse(ChatCompletionChunk, with_call)) == with_call
    fragment = {"index": 0, "function": {"arguments": '{"a'}}  # a call's later piece: no id, type or name
    with_fragment = {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [fragment]}, "logprobs": None, "finish_reason": None}]}
    assert data_of(sse(ChatCompletionChunk, with_fragment)) == with_fragment
    assert DONE == "data: [DONE]\n\n"
    assert data_of(sse_error("lost", 503)) == {"error": {"message": "lost", "type": "server_error", "param": None, "code": 503}}


@pytest.mark.parametrize(
    "frame",
    [
        {**BASE, "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": "done"}]},  # not a reason
        {**BASE, "choices": [{"index": 0, "text": "Hi", "logprobs": None, "finish_reason": None}]},  # a completion's choice
        {**BASE, "choices": [], "extra": 1},
    ],
)
def test_a_frame_that_does_not_conform_raises(frame: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        sse(ChatCompletionChunk, frame)


def test_completion_events_are_completion_chunks() -> None:
    frame = {**BASE, "object": "text_completion", "choices": [{"index": 0, "text": "Hi", "logprobs": None, "finish_reason": "length"}]}
    assert data_of(sse(CompletionChunk, frame)) == frame
    with pytest.raises(pydantic.ValidationError):
        sse(CompletionChunk, {**frame, "object": "chat.completion.chunk"})
