"""OpenAI-compatible completions for the generators: `POST /v1/completions`, `GET /v1/models`."""

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.api.backend import MODEL_EXTENSION, Backends, final_chunk, open_stream
from service.api.errors import APIError
from service.api.routing import model_by_name
from service.api.schemas import (
    MODEL_ERRORS,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    OpenAIError,
    error_responses,
    event_stream,
)
from service.api.streams import sse, sse_error
from service.config import ServiceConfig
from service.protocol import Chunk, GenerateRequest

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


def generate_request(body: CompletionRequest, config: ServiceConfig) -> GenerateRequest:
    """The completion as a model request; a missing max_tokens is the engine's to decide."""
    unsupported = body.unsupported_field()
    if unsupported is not None:
        raise APIError(400, f"{unsupported} is not supported by this server; leave it at its default", unsupported)
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    if len(prompts) != 1:
        raise APIError(400, "prompt must be one string (lists of one are accepted)", "prompt")
    prompt = prompts[0]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if len(prompt) > config.max_prompt_chars:
        raise APIError(400, f"prompt has {len(prompt)} characters; the limit is {config.max_prompt_chars}", "prompt")
    return GenerateRequest(
        text=prompt,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        seed=body.seed,
        stop=tuple(body.stop or ()),
        stream=body.stream,
    )


@router.post(
    "/v1/completions",
    tags=["openai"],
    response_model=CompletionResponse,
    responses={**MODEL_ERRORS, **event_stream(CompletionChunk)},
    openapi_extra={MODEL_EXTENSION: "generator"},
)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    """OpenAI completions; `stream: true` answers with server-sent events in OpenAI's format."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    model = model_by_name(config, "generator", body.model).name
    stream = await open_stream(backends.models[model], generate_request(body, config), config.retry_after_seconds)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    if body.stream:
        options = body.stream_options
        include_usage, continuous = (options.include_usage, options.continuous_usage_stats) if options else (False, False)
        return StreamingResponse(stream_completion(stream, base, include_usage, continuous), media_type="text/event-stream")
    last = await final_chunk(stream, "internal error during generation", config.retry_after_seconds)
    return {
        **base,
        "choices": [{"index": 0, "text": last.text, "logprobs": None, "finish_reason": last.finish_reason}],
        "usage": usage(last),
    }


def usage(chunk: Chunk) -> dict[str, int]:
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
    }


async def stream_completion(
    stream: AsyncIterator[Chunk], base: dict[str, Any], include_usage: bool, continuous_usage: bool = False
) -> AsyncIterator[str]:
    """OpenAI's stream: a frame per chunk with text; with include_usage a last frame of usage
    alone; with continuous_usage_stats (vLLM's extension) the usage so far on every frame. A
    failure after the 200 (the engine's, or a lost replica's: a 503 that may be retried) is one
    error frame, then [DONE]."""
    try:
        async for chunk in stream:
            if chunk.finish_reason == "error":
                yield sse_error("internal error during generation", 500)
                break
            if chunk.text or chunk.finish_reason is not None:
                choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": chunk.finish_reason}
                yield sse({**base, "choices": [choice], **({"usage": usage(chunk)} if continuous_usage else {})})
            if chunk.finish_reason is not None and include_usage:
                yield sse({**base, "choices": [], "usage": usage(chunk)})
    except APIError as error:
        yield sse_error(error.message, error.status)
    yield sse("[DONE]")
