"""OpenAI-compatible completions for the generator: `POST /v1/completions`, `GET /v1/models`."""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.api.backend import Backends, open_stream
from service.api.errors import APIError
from service.api.schemas import CompletionRequest
from service.config import ServiceConfig

router = APIRouter()

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request; `error.param` names the field"},
    404: {"description": "Unknown model"},
    413: {"description": "Body too large"},
    429: {"description": "Engine queue full; retry after `Retry-After` seconds"},
    503: {"description": "No replica available or the service is overloaded (Ray Serve)"},
}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@router.get("/v1/models", tags=["openai"])
async def list_models(request: Request) -> dict[str, Any]:
    config: ServiceConfig = request.app.state.config
    created = request.app.state.started
    return {
        "object": "list",
        "data": [
            {"id": m.name, "object": "model", "created": created, "owned_by": "transformer-serving"}
            for m in (config.generator, config.translator)
        ],
    }


def completion_payload(body: CompletionRequest, config: ServiceConfig) -> dict[str, Any]:
    if body.model is not None and body.model != config.generator.name:
        hint = " (translation is served at /v1/translate)" if body.model == config.translator.name else ""
        raise APIError(404, f"The model `{body.model}` does not exist{hint}.", "model")
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
    return {
        "text": prompt,
        "max_tokens": body.max_tokens,
        "default_max_tokens": 16,  # OpenAI's default when max_tokens is omitted
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": max(body.top_k, 0),
        "seed": body.seed,
        "stop": body.stop,
        "stream": body.stream,
    }


@router.post("/v1/completions", tags=["openai"], responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    """OpenAI completions; `stream: true` answers with server-sent events in OpenAI's format."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    payload = completion_payload(body, config)
    stream = await open_stream(backends.generator, payload, config.retry_after_seconds)
    model = config.generator.name
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream_completion(stream, base, include_usage), media_type="text/event-stream")
    text, last = "", None
    async for item in stream:
        if item.get("error"):
            raise APIError(500, "internal error during generation", counted=True)  # the replica counted it
        text += item["text"]
        last = item
    assert last is not None
    return {
        **base,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last["finish_reason"]}],
        "usage": usage(last),
    }


def usage(item: dict[str, Any]) -> dict[str, int]:
    return {
        "prompt_tokens": item["prompt_tokens"],
        "completion_tokens": item["completion_tokens"],
        "total_tokens": item["prompt_tokens"] + item["completion_tokens"],
    }


async def stream_completion(stream: AsyncIterator[dict[str, Any]], base: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    async for item in stream:
        if item.get("error"):
            yield sse({"error": {"message": "internal error during generation", "type": "internal_error", "param": None, "code": 500}})
            break
        reason = item["finish_reason"]
        if item["text"] or reason is not None:
            yield sse({**base, "choices": [{"index": 0, "text": item["text"], "logprobs": None, "finish_reason": reason}]})
        if reason is not None and include_usage:
            yield sse({**base, "choices": [], "usage": usage(item)})
    yield sse("[DONE]")
