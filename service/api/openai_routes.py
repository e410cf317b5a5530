"""OpenAI-compatible routes for the generators: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models`, and vLLM's `POST /tokenize` and `POST /detokenize`."""

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from decoding.sampling_params import SamplingParams
from service.api.backend import MODEL_EXTENSION, Backends, answered, ended_in_failure, failed, final_chunk, open_streams
from service.api.errors import APIError
from service.api.routing import model_by_name, model_of_any_kind
from service.api.schemas import (
    MAX_CHOICES,
    MODEL_ERRORS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageBody,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeBody,
    DetokenizeResponse,
    JSONObjectFormat,
    JSONSchemaResponseFormat,
    ModelList,
    NamedToolChoice,
    OpenAIError,
    SamplingRequest,
    TokenizeBody,
    TokenizeResponse,
    TokenizerInfoResponse,
    error_responses,
    event_stream,
)
from service.api.streams import DONE, merged, sse, sse_error
from service.config import ServiceConfig
from service.engine.config import FinishReason, StructuredOutput
from service.protocol import ChatMessage, Chunk, GenerateRequest, TokenizeRequest, Tool, ToolCall, ToolCallPiece

router = APIRouter()


@router.get("/v1/models", tags=["openai"], response_model=ModelList, responses=error_responses(OpenAIError, 401, 503))
async def list_models(request: Request) -> dict[str, Any]:
    config: ServiceConfig = request.app.state.config
    created = request.app.state.started
    return {
        "object": "list",
        "data": [
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "transformer-serving",
                "kind": m.kind,
                "source_lang": m.source_lang,
                "target_lang": m.target_lang,
            }
            for m in config.models
        ],
    }


def sampling_fields(body: SamplingRequest) -> dict[str, Any]:
    """The request's generation fields, as the engine takes them (GenerateRequest's)."""
    unsupported = body.unsupported_field()
    if unsupported is not None:
        raise APIError(400, f"{unsupported} is not supported by this server; leave it at its default", unsupported)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or max_tokens
    return {
        "max_tokens": max_tokens,
        "sampling": SamplingParams(
            temperature=body.temperature,
            top_k=max(body.top_k, 0),
            top_p=body.top_p,
            min_p=body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=tuple((int(token), bias) for token, bias in (body.logit_bias or {}).items()),
        ),
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "speculate": body.speculative_decoding,
        "stop": tuple(body.stop or ()),
        "stream": body.stream,
        "structured": structured_output(body),
    }


ANY_OBJECT = json.dumps({"type": "object"})


def structured_output(body: SamplingRequest) -> StructuredOutput | None:
    """The output's constraint: OpenAI's response_format or vLLM's structured_outputs (not both)."""
    form, constraint = body.response_format, body.structured_outputs
    if constraint is not None and form is not None and form.type != "text":
        raise APIError(400, "send one of response_format and structured_outputs", "structured_outputs")
    if isinstance(form, JSONObjectFormat):
        return StructuredOutput("json", ANY_OBJECT, "response_format")
    if isinstance(form, JSONSchemaResponseFormat):
        strict = bool(form.json_schema.strict)
        return StructuredOutput("json", json.dumps(form.json_schema.schema_), "response_format.json_schema.schema", strict)
    if constraint is None:
        return None
    if constraint.disable_any_whitespace and constraint.whitespace_pattern is not None:
        raise APIError(400, "send one of disable_any_whitespace and whitespace_pattern", "structured_outputs.whitespace_pattern")
    whitespace = "" if constraint.disable_any_whitespace else constraint.whitespace_pattern
    given = {"json": constraint.json_, "regex": constraint.regex, "choice": constraint.choice, "grammar": constraint.grammar}
    given = {kind: value for kind, value in given.items() if value is not None}
    if constraint.json_object:
        given["json_object"] = ANY_OBJECT
    if len(given) != 1:
        raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar and json_object", "structured_outputs")
    ((kind, value),) = given.items()
    param = f"structured_outputs.{kind}"
    if kind in ("json", "json_object", "choice"):
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutput("choice", text, param) if kind == "choice" else StructuredOutput("json", text, param, whitespace=whitespace)
    return StructuredOutput("regex" if kind == "regex" else "grammar", str(value), param)


def chat_messages(bodies: list[ChatMessageBody]) -> tuple[ChatMessage, ...]:
    """The chat as the replica renders it; 400 for a message without content (an assistant's may
    have tool calls instead), a tool's without the call it answers, arguments that are not a JSON object."""
    messages = []
    for i, m in enumerate(bodies):
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
        for call in calls:
            try:
                arguments = json.loads(call.arguments)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past Python's limit
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(400, f"messages[{i}]: a tool call's arguments must be a JSON object", "messages")
        if calls and m.role != "assistant":
            raise APIError(400, f"messages[{i}]: only an assistant's message has tool_calls", "messages")
        if m.text() is None and not calls:
            raise APIError(400, f"messages[{i}]: content is required (an assistant's may be tool_calls instead)", "messages")
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(400, f"messages[{i}]: a tool's message needs the tool_call_id it answers", "messages")
        messages.append(ChatMessage(m.role, m.text(), calls, m.tool_call_id))
    return tuple(messages)


class FunctionSpec(Protocol):
    """A function tool as a request declares it (chat completions' `function`, a Responses API tool)."""

    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str | None: ...
    @property
    def parameters(self) -> dict[str, Any] | None: ...
    @property
    def strict(self) -> bool | None: ...


def function_tool_fields(
    functions: Sequence[FunctionSpec], choice: str | None, named: str | None, parallel: bool, parameters_field: Callable[[int], str]
) -> dict[str, Any]:
    """The request's tools, as the engine takes them (GenerateRequest's): `named` (a function
    tool_choice names) is "required" of that one function. parameters_field(i): where function i's
    parameters are in the request, for the 400 that refuses them."""
    if not functions:
        if named is not None or choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return {}
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: every function needs its own name", "tools")
    if named is not None:
        if named not in names:
            raise APIError(400, f"tool_choice names {named!r}, which is not among tools", "tool_choice")
        choice = "required"
    no_arguments = {"type": "object", "properties": {}}
    for i, f in enumerate(functions):
        if f.parameters is not None and f.parameters.get("type") != "object":
            raise APIError(400, "a function's parameters must be a JSON schema of an object (type: object)", parameters_field(i))
    tools = tuple(Tool(f.name, f.description, json.dumps(f.parameters or no_arguments), bool(f.strict)) for f in functions)
    return {"tools": tools, "tool_choice": choice or "auto", "tool_name": named, "parallel_tool_calls": parallel}


def tool_fields(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat's tools, as the engine takes them (function_tool_fields)."""
    named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
    choice = None if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
    functions = [t.function for t in body.tools or []]
    return function_tool_fields(functions, choice, named, body.parallel_tool_calls, lambda i: f"tools.{i}.function.parameters")


def prompts_of(body: CompletionRequest) -> list[str | tuple[int, ...]]:
    """The batch of prompts: texts, or token id sequences (a list of ints is one prompt)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    tokens = [token for token in prompt if isinstance(token, int)]
    if prompt and len(tokens) == len(prompt):
        return [tuple(tokens)]
    return [p if isinstance(p, str) else tuple(p) for p in prompt if not isinstance(p, int)]


def generate_requests(body: CompletionRequest) -> list[GenerateRequest]:
    """The completion as model requests, one per prompt; a missing max_tokens is the engine's to decide."""
    fields = sampling_fields(body)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 asks for the prompt alone: it needs echo", "max_tokens")
    prompts = prompts_of(body)
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"prompts times n must be at most {MAX_CHOICES}", "n")
    requests = []
    for prompt in prompts:
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        text, ids = (prompt, None) if isinstance(prompt, str) else ("", prompt)
        requests.append(GenerateRequest(text=text, prompt_ids=ids, logprobs=body.logprobs, echo=body.echo, **fields))
    return requests


def choices(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """n independent samples of one request: with a seed, choice i samples with seed + i."""
    seed = request.sampling.seed
    return [request if seed is None else request.seeded((seed + i) % 2**63) for i in range(n)]


def stream_flags(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streamed request."""
    options = body.stream_options
    return (options.include_usage, options.continuous_usage_stats) if options else (False, False)


@router.post(
    "/v1/completions",
    tags=["openai"],
    response_model=CompletionResponse,
    responses={**MODEL_ERRORS, **event_stream(CompletionChunk)},
    openapi_extra={MODEL_EXTENSION: "generator"},
)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    """OpenAI completions; `stream: true` answers with server-sent events in OpenAI's format;
    `n` independent choices."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    model = model_by_name(config, "generator", body.model).name
    requests = [c for request in generate_requests(body) for c in choices(request, body.n)]
    streams = await open_streams(backends.models[model], requests, config.retry_after_seconds)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    frames = CompletionFrames(body.echo, body.logprobs is not None)
    if body.stream:
        events = stream_choices(CompletionChunk, streams, base, frames, body.n, *stream_flags(body))
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await final_chunks(streams, config.retry_after_seconds)
    return {**base, "choices": [frames(i, c, True)[0] for i, c in enumerate(finals)], "usage": usage(finals, body.n)}


@router.post(
    "/v1/chat/completions",
    tags=["openai"],
    response_model=ChatCompletionResponse,
    response_model_exclude_unset=True,
    responses={**MODEL_ERRORS, **event_stream(ChatCompletionChunk)},
    openapi_extra={MODEL_EXTENSION: "generator"},
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI chat completions: the messages rendered with the model's chat template (a model
    without one answers 400), the assistant's reply generated; `stream: true` sends the role,
    then content deltas, then [DONE]."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    model = model_by_name(config, "generator", body.model).name
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fields = {**sampling_fields(body), **tool_fields(body)}
    requests = choices(GenerateRequest(text="", messages=chat_messages(body.messages), logprobs=logprobs, **fields), body.n)
    streams = await open_streams(backends.models[model], requests, config.retry_after_seconds)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    calls_end = fields.get("tool_name") is None  # a named function's call ends with "stop", as OpenAI's
    if body.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}
        chat_frames = ChatFrames(body.logprobs, calls_end)
        frames = stream_choices(ChatCompletionChunk, streams, chunk_base, chat_frames, body.n, *stream_flags(body))
        return StreamingResponse(frames, media_type="text/event-stream")
    finals = await final_chunks(streams, config.retry_after_seconds)
    return {
        **base,
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                "message": chat_message(c),
                "logprobs": chat_logprobs(c) if body.logprobs else None,
                "finish_reason": chat_finish(c.finish_reason, bool(c.tool_calls) and calls_end),
            }
            for i, c in enumerate(finals)
        ],
        "usage": usage(finals, body.n),
    }


def tool_call_out(call: ToolCallPiece) -> dict[str, Any]:
    """A whole call (its pieces joined) as chat completions answer it."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(piece: ToolCallPiece) -> dict[str, Any]:
    """A piece of a call as a chat stream sends it: id, type and name on the call's first piece."""
    first = {"id": piece.id, "type": "function"} if piece.name is not None else {}
    name = {"name": piece.name} if piece.name is not None else {}
    return {"index": piece.index, **first, "function": {**name, "arguments": piece.arguments}}


def chat_message(chunk: Chunk) -> dict[str, Any]:
    """A whole reply: its text, or its tool calls and the text around them (None when only space)."""
    if not chunk.tool_calls:
        return {"role": "assistant", "content": chunk.text}
    return {"role": "assistant", "content": chunk.text.strip() or None, "tool_calls": [tool_call_out(c) for c in chunk.tool_calls]}


def chat_finish(reason: FinishReason | None, called: bool) -> str | None:
    """A chat's finish reason: "tool_calls" for a reply that ended after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


async def final_chunks(streams: list[AsyncGenerator[Chunk, None]], retry_after: int) -> list[Chunk]:
    """Each choice's stream read to its end; any failure closes the others and is raised."""
    tasks = [asyncio.ensure_future(final_chunk(s, "generation", retry_after)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(chunks: dict[int, Chunk] | list[Chunk], n: int) -> dict[str, int]:
    """Each prompt counted once (its n choices read the same; choice i is prompt i // n's), the
    choices' tokens summed. chunks: the choices' latest, by index."""
    by_index = chunks if isinstance(chunks, dict) else dict(enumerate(chunks))
    prompt_tokens = sum(c.prompt_tokens for i, c in by_index.items() if i % n == 0)
    completion_tokens = sum(c.completion_tokens for c in by_index.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(chunk: Chunk, echo: bool, offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs of a chunk's tokens (the prompt's first, with echo); text offsets
    from `offset`, each token's text following the previous one's."""
    scored = [*chunk.prompt_logprobs, *chunk.logprobs] if echo else list(chunk.logprobs)
    tokens = [str(s.token) for s in scored]
    return {
        "tokens": tokens,
        "token_logprobs": [s.logprob for s in scored],
        # The top alternatives and the token itself (as vLLM answers: a greedy check compares them).
        "top_logprobs": [None if s.logprob is None else {**{str(t): lp for t, lp in s.top}, str(s.token): s.logprob} for s in scored],
        "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else [],
    }


@dataclass
class CompletionFrames:
    """A completions stream's choice for each chunk: its text, the prompt's before it on the first
    with echo, and with logprobs its tokens' (text offsets running on over each choice's stream).
    No frame for a chunk without text before the end, but for a choice's first tokens: a client
    sees its first token when it is made, even one that is no whole character yet (vLLM sends a
    frame for every step that made tokens, text or not)."""

    echo: bool
    logprobs: bool
    next_offset: dict[int, int] = field(default_factory=dict)  # by choice
    begun: set[int] = field(default_factory=set)  # the choices whose first tokens have been sent

    def __call__(self, index: int, chunk: Chunk, first: bool) -> list[dict[str, Any]]:
        text = (chunk.echo or "") + chunk.text if self.echo else chunk.text
        if chunk.completion_tokens > 0 and index not in self.begun:  # the choice's first tokens
            self.begun.add(index)
        elif not text and chunk.finish_reason is None and not chunk.logprobs:
            return []
        scores = None
        if self.logprobs:
            offset = self.next_offset.get(index, 0)
            scores = completion_logprobs(chunk, self.echo, offset)
            self.next_offset[index] = offset + sum(len(t) for t in scores["tokens"])
        return [{"index": index, "text": text, "logprobs": scores, "finish_reason": chunk.finish_reason}]


def chat_logprobs(chunk: Chunk) -> dict[str, Any]:
    """OpenAI's chat logprobs of a chunk's tokens (their text, logprob, UTF-8 bytes, top ones)."""

    def entry(token: int | str, logprob: float | None) -> dict[str, Any]:
        return {"token": str(token), "logprob": logprob, "bytes": list(str(token).encode("utf-8"))}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in chunk.logprobs]}


@dataclass
class ChatFrames:
    """A chat stream's choices for one chunk: the role alone first, then content (with logprobs:
    its tokens'), each piece of a tool call as it comes (its id and name first), then the finish
    reason with an empty delta (as OpenAI sends them; "tool_calls" after calls unless calls_end is
    False)."""

    logprobs: bool
    calls_end: bool = True
    called: set[int] = field(default_factory=set)  # the choices that have called tools

    def __call__(self, index: int, chunk: Chunk, first: bool) -> list[dict[str, Any]]:
        frames: list[dict[str, Any]] = []
        if first:
            frames.append({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        if chunk.text or (self.logprobs and chunk.logprobs):  # tokens of a character not yet whole: their logprobs now
            scores = chat_logprobs(chunk) if self.logprobs else None
            frames.append({"index": index, "delta": {"content": chunk.text}, "logprobs": scores, "finish_reason": None})
        for piece in chunk.tool_calls:
            self.called.add(index)
            frames.append({"index": index, "delta": {"tool_calls": [tool_call_delta(piece)]}, "logprobs": None, "finish_reason": None})
        if chunk.finish_reason is not None:
            reason = chat_finish(chunk.finish_reason, self.calls_end and index in self.called)
            frames.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return frames


async def stream_choices(
    event: type[CompletionChunk] | type[ChatCompletionChunk],
    streams: list[AsyncGenerator[Chunk, None]],
    base: dict[str, Any],
    frame: Callable[[int, Chunk, bool], list[dict[str, Any]]],
    n: int,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """OpenAI's stream of n choices, each event an `event` (the route's documented chunk): an event
    per choice frame (`frame`); with include_usage a last
    event of the usage alone; with continuous_usage_stats (vLLM's extension) the usage so far on
    every event. A failure after the 200 (the engine's, or a lost replica's: a 503 that may be
    retried) is one error event, then [DONE]."""
    latest: dict[int, Chunk] = {}
    try:
        async for index, chunk in merged(streams):
            if failed(chunk):
                raise ended_in_failure(chunk, "generation")
            first = index not in latest
            latest[index] = chunk
            so_far = {"usage": usage(latest, n)} if continuous_usage else {}
            for choice in frame(index, chunk, first):
                yield sse(event, {**base, "choices": [choice], **so_far})
        else:
            if include_usage:
                yield sse(event, {**base, "choices": [], "usage": usage(latest, n)})
    except APIError as error:
        yield sse_error(error.message, error.status)
    yield DONE


@router.post("/tokenize", tags=["vllm"], response_model=TokenizeResponse, response_model_exclude_none=True, responses=MODEL_ERRORS)
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    """vLLM's tokenize: a prompt's token ids as the model reads it (or a chat's, rendered by the
    model's template), and the serving context; `return_token_strs` adds each token's text."""
    config: ServiceConfig = request.app.state.config
    model = model_of_any_kind(config, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send one of prompt and messages", "prompt")
    text = body.prompt or ""
    messages = chat_messages(body.messages) if body.messages is not None else None
    backend = request.app.state.backends.models[model.name]
    tokenized = await backend.tokenize(TokenizeRequest(text, messages, body.add_special_tokens))
    tokens = answered(tokenized, config.retry_after_seconds)
    answer: dict[str, Any] = {"count": len(tokens.ids), "max_model_len": tokens.max_model_len, "tokens": list(tokens.ids)}
    if body.return_token_strs:
        answer["token_strs"] = list(tokens.pieces)
    return answer


@router.get("/tokenizer_info", tags=["vllm"], response_model=TokenizerInfoResponse, responses=MODEL_ERRORS)
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    """vLLM's tokenizer_info, for a client's own tokenizer (lm-evaluation-harness's remote one):
    the special tokens whose text encodes back to them, the serving context, the chat template."""
    config: ServiceConfig = request.app.state.config
    served = model_of_any_kind(config, model)
    return asdict(await request.app.state.backends.models[served.name].tokenizer_info())


@router.post("/detokenize", tags=["vllm"], response_model=DetokenizeResponse, responses=MODEL_ERRORS)
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    """vLLM's detokenize: the text of token ids (special tokens dropped)."""
    config: ServiceConfig = request.app.state.config
    model = model_of_any_kind(config, body.model)
    backend = request.app.state.backends.models[model.name]
    return {"prompt": answered(await backend.detokenize(tuple(body.tokens)), config.retry_after_seconds)}
