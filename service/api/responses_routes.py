"""OpenAI's Responses API for the generators, on the same engine as chat completions:
`POST /v1/responses` (streamed or not), and, for stored responses, `GET` and `DELETE
/v1/responses/{response_id}`. The input (a string, or messages, function calls and their outputs)
and `instructions` become a chat rendered by the model's template; the reply's text becomes a
message item and each tool call a function_call item. `previous_response_id` continues a stored
response's conversation (service/api/response_store.py)."""

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from decoding.sampling_params import SamplingParams
from service.api.backend import MODEL_EXTENSION, Backends, ended_in_failure, failed, final_chunk, open_stream
from service.api.errors import APIError
from service.api.openai_routes import ANY_OBJECT, function_tool_fields
from service.api.response_store import ResponseStore, StoredResponse, owner_of
from service.api.responses_schemas import (
    BuiltInToolBody,
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionToolBody,
    InputMessage,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)
from service.api.routing import model_by_name
from service.api.schemas import MODEL_ERRORS, OpenAIError, error_responses, inlined_schema
from service.config import ServiceConfig
from service.engine.config import StructuredOutput
from service.protocol import ChatMessage, Chunk, GenerateRequest, ToolCall

router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


def owner(request: Request) -> str:
    """The requester, as the store tells owners apart: by the API key it sent (service/api/auth.py checked it)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    config: ServiceConfig = request.app.state.config
    return owner_of(key.strip() if config.api_keys and scheme.lower() == "bearer" else None)


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming the first field set to something this server does not do."""
    if body.background:
        raise APIError(400, "background responses are not supported: send the request and read its answer (or stream it)", "background")
    if body.reasoning:
        raise APIError(400, "reasoning is not supported: the model has no reasoning items", "reasoning")
    if body.include:
        raise APIError(400, "include is not supported: the response has no extra outputs to include", "include")
    if body.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported: a conversation past the context is refused", "truncation")
    for i, tool in enumerate(body.tools or []):
        if isinstance(tool, BuiltInToolBody):
            if tool.type == "function":
                raise APIError(400, "a function tool takes type, name, description, parameters and strict", f"tools.{i}")
            raise APIError(400, f"built-in tools ({tool.type}) are not supported; only function tools", f"tools.{i}.type")


def input_messages(body: ResponsesRequest) -> tuple[ChatMessage, ...]:
    """The input as chat messages: a string is the user's message; consecutive function_call items
    (and an assistant message just before them) are one assistant turn; a function_call_output is
    a tool message."""
    if isinstance(body.input, str):
        return (ChatMessage("user", body.input),)
    if not body.input:
        raise APIError(400, "input must not be empty", "input")
    messages: list[ChatMessage] = []
    for i, item in enumerate(body.input):
        if isinstance(item, InputMessage):
            messages.append(ChatMessage(item.role, item.text()))
        elif isinstance(item, FunctionCallItem):
            try:
                arguments = json.loads(item.arguments)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(400, "a function_call's arguments must be a JSON object", f"input.{i}.arguments")
            call = ToolCall(item.call_id, item.name, item.arguments)
            if messages and messages[-1].role == "assistant":
                messages[-1] = replace(messages[-1], tool_calls=(*messages[-1].tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", None, (call,)))
        else:
            assert isinstance(item, FunctionCallOutputItem)
            messages.append(ChatMessage("tool", item.output, (), item.call_id))
    return tuple(messages)


def text_format(body: ResponsesRequest) -> StructuredOutput | None:
    form = body.text.format if body.text is not None else None
    if isinstance(form, TextFormatJSONObject):
        return StructuredOutput("json", ANY_OBJECT, "text.format")
    if isinstance(form, TextFormatJSONSchema):
        return StructuredOutput("json", json.dumps(form.schema_), "text.format.schema", bool(form.strict))
    return None


def tool_fields(body: ResponsesRequest) -> dict[str, Any]:
    functions = [t for t in body.tools or [] if isinstance(t, FunctionToolBody)]
    named = body.tool_choice.name if isinstance(body.tool_choice, FunctionChoice) else None
    choice = None if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice
    return function_tool_fields(functions, choice, named, body.parallel_tool_calls, lambda i: f"tools.{i}.parameters")


def generate_request(body: ResponsesRequest, messages: tuple[ChatMessage, ...]) -> GenerateRequest:
    fields = tool_fields(body)
    structured = text_format(body)
    if structured is not None and fields.get("tool_choice") == "required":
        raise APIError(400, "a forced tool call cannot also take text.format", "tool_choice")
    return GenerateRequest(
        text="",
        messages=messages,
        max_tokens=body.max_output_tokens,
        sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p),
        stream=body.stream,
        structured=structured,
        **fields,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseBuilder:
    """A response as it forms: its fields from the request, its output items as the reply's chunks
    come (text to a message item, each tool call to a function_call item), and the events that
    tell a stream of each step (`events`, drained by the streaming route)."""

    base: dict[str, Any]
    output: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0
    open_message: int | None = None  # the output index of the message item taking text
    open_call: int | None = None  # the output index of the function_call item taking arguments
    space: str = ""  # the text's trailing whitespace, not yet sent: dropped before a call
    usage: dict[str, Any] | None = None

    def emit(self, event_type: str, **fields: Any) -> None:
        self.events.append({"type": event_type, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def response(self, status: str, **fields: Any) -> dict[str, Any]:
        return {**self.base, "status": status, "output": [dict(item) for item in self.output], "usage": self.usage, **fields}

    def start(self) -> None:
        self.emit("response.created", response=self.response("in_progress"))
        self.emit("response.in_progress", response=self.response("in_progress"))

    def add(self, chunk: Chunk) -> None:
        """The chunk's text and tool calls, as output items and events."""
        text = self.space + chunk.text
        body = text.rstrip()
        self.space = text[len(body) :]  # held back: whitespace before a call is no part of the answer's text
        if body:
            self._close_call()
            self._text(body)
        for piece in chunk.tool_calls:
            if piece.name is not None:  # a call begins
                self._close_message()
                self._close_call()
                self.space = ""
                item = {
                    "type": "function_call",
                    "id": new_id("fc"),
                    "call_id": piece.id,
                    "name": piece.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self.output.append(item)
                self.open_call = len(self.output) - 1
                self.emit("response.output_item.added", output_index=self.open_call, item=dict(item))
            assert self.open_call is not None, "a call's first piece names it"
            if piece.arguments:
                call = self.output[self.open_call]
                call["arguments"] += piece.arguments
                self.emit("response.function_call_arguments.delta", item_id=call["id"], output_index=self.open_call, delta=piece.arguments)

    def _close_call(self, status: str = "completed") -> None:
        if self.open_call is None:
            return
        index, self.open_call = self.open_call, None
        item = self.output[index]
        item["status"] = status
        self.emit(
            "response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"], name=item["name"]
        )
        self.emit("response.output_item.done", output_index=index, item=dict(item))

    def _text(self, text: str) -> None:
        if self.open_message is None:
            item: dict[str, Any] = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            self.output.append(item)
            self.open_message = len(self.output) - 1
            self.emit("response.output_item.added", output_index=self.open_message, item={**item, "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"] = [part]
            self.emit("response.content_part.added", item_id=item["id"], output_index=self.open_message, content_index=0, part=dict(part))
        message = self.output[self.open_message]
        message["content"][0]["text"] += text
        self.emit(
            "response.output_text.delta", item_id=message["id"], output_index=self.open_message, content_index=0, delta=text, logprobs=[]
        )

    def _close_message(self, status: str = "completed") -> None:
        if self.open_message is None:
            return
        index, self.open_message = self.open_message, None
        item = self.output[index]
        part = item["content"][0]
        item["status"] = status
        self.emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=[])
        self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part))
        self.emit("response.output_item.done", output_index=index, item={**item, "content": [dict(part)]})

    def finish(self, chunk: Chunk) -> dict[str, Any]:
        """The finished response (status completed, or incomplete at max_output_tokens) and its last event."""
        incomplete = chunk.finish_reason == "length"
        if self.space and (self.open_message is not None or not self.output):  # the text's end (or a reply of space alone)
            self._text(self.space)
        self._close_message("incomplete" if incomplete else "completed")
        self._close_call("incomplete" if incomplete else "completed")
        self.usage = {
            "input_tokens": chunk.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": chunk.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
        }
        details = {"reason": "max_output_tokens"} if incomplete else None
        final = self.response("incomplete" if incomplete else "completed", incomplete_details=details)
        self.emit("response.incomplete" if incomplete else "response.completed", response=final)
        return final

    def fail(self, error: APIError) -> None:
        failed_response = self.response(
            "failed", error={"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
        )
        self.emit("response.failed", response=failed_response)


def output_messages(output: list[dict[str, Any]]) -> tuple[ChatMessage, ...]:
    """A response's output items as the assistant's turn of a conversation (for previous_response_id)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = tuple(ToolCall(i["call_id"], i["name"], i["arguments"]) for i in output if i["type"] == "function_call")
    return (ChatMessage("assistant", text if text or not calls else None, calls),)


def response_base(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The fields a response repeats from its request."""
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice or "auto"
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {"format": {"type": "text"}}
    return {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": text,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "metadata": body.metadata or {},
    }


def event_lines(event: dict[str, Any]) -> str:
    """One server-sent event as OpenAI sends them: `event: <type>`, then the event as JSON."""
    data = ResponseStreamEvent.model_validate(event).model_dump_json(exclude_unset=True)
    return f"event: {event['type']}\ndata: {data}\n\n"


RESPONSE_EVENTS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": (
            "The response; with `stream: true`, server-sent events (`event: <type>`, `data: <event>`),"
            " the last response.completed, response.incomplete or response.failed"
        ),
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["event", "data"],
                    "properties": {
                        "event": {"type": "string"},
                        "data": {
                            "type": "string",
                            "contentMediaType": "application/json",
                            "contentSchema": inlined_schema(ResponseStreamEvent),
                        },
                    },
                }
            }
        },
    }
}


@router.post(
    "/v1/responses",
    tags=["openai"],
    response_model=ResponseObject,
    responses={**MODEL_ERRORS, **RESPONSE_EVENTS},
    openapi_extra={MODEL_EXTENSION: "generator"},
)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    """OpenAI's Responses API: the input (and a stored response's conversation before it, with
    `previous_response_id`) answered as output items; `stream: true` sends the typed events."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    model = model_by_name(config, "generator", body.model).name
    refuse_unsupported(body)
    previous: StoredResponse | None = None
    if body.previous_response_id is not None:
        previous = store_of(request).get(owner(request), body.previous_response_id)
        if previous is None:
            raise APIError(404, f"no stored response {body.previous_response_id!r}", "previous_response_id")
    conversation = (previous.conversation if previous else ()) + input_messages(body)
    system = (ChatMessage("system", body.instructions),) if body.instructions is not None else ()
    stream = await open_stream(backends.models[model], generate_request(body, system + conversation), config.retry_after_seconds)
    builder = ResponseBuilder(response_base(body, model))
    keep = body.store, store_of(request), owner(request), conversation

    if body.stream:
        return StreamingResponse(stream_events(stream, builder, keep), media_type="text/event-stream")
    whole = await final_chunk(stream, "generation", config.retry_after_seconds)
    builder.add(whole)
    final = builder.finish(whole)
    remember(final, keep)
    return final


def remember(final: dict[str, Any], keep: tuple[bool, ResponseStore, str, tuple[ChatMessage, ...]]) -> None:
    """Stores a finished response (when the request asked for it) with its conversation."""
    store, responses, requester, conversation = keep
    if store:
        responses.put(requester, final, conversation + output_messages(final["output"]))


async def stream_events(
    stream: AsyncGenerator[Chunk, None], builder: ResponseBuilder, keep: tuple[bool, ResponseStore, str, tuple[ChatMessage, ...]]
) -> AsyncIterator[str]:
    """The response's events as its chunks come; a failure after the start is a response.failed event."""
    builder.start()
    try:
        async for chunk in stream:
            if failed(chunk):
                raise ended_in_failure(chunk, "generation")
            builder.add(chunk)
            if chunk.finish_reason is not None:
                remember(builder.finish(chunk), keep)
            for event in builder.events:
                yield event_lines(event)
            builder.events.clear()
    except APIError as error:
        builder.fail(error)
        for event in builder.events:
            yield event_lines(event)
    finally:
        await stream.aclose()


NOT_FOUND = error_responses(OpenAIError, 401, 404, 503)


@router.get("/v1/responses/{response_id}", tags=["openai"], response_model=ResponseObject, responses=NOT_FOUND)
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    """A stored response, to the API key that made it (to any other: 404)."""
    stored = store_of(request).get(owner(request), response_id)
    if stored is None:
        raise APIError(404, f"no stored response {response_id!r}", "response_id")
    return stored.response


@router.delete("/v1/responses/{response_id}", tags=["openai"], response_model=DeletedResponse, responses=NOT_FOUND)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    """Deletes a stored response (the API key that made it only; to any other: 404)."""
    if not store_of(request).delete(owner(request), response_id):
        raise APIError(404, f"no stored response {response_id!r}", "response_id")
    return {"id": response_id, "object": "response", "deleted": True}
