"""Translation: `POST /v1/translate` and the LibreTranslate-compatible `/translate`, `/languages`.

A list of sentences becomes one engine request per sentence, submitted together, so they batch
with each other and with other clients' sentences at every decode step.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from service.api.backend import Backends, open_stream
from service.api.errors import APIError
from service.api.openai_routes import ERROR_RESPONSES, sse
from service.api.schemas import LibreTranslateRequest, TranslateRequest
from service.config import ServiceConfig

router = APIRouter()

LANGUAGES = [{"code": "en", "name": "English", "targets": ["de"]}, {"code": "de", "name": "German", "targets": []}]


def check_texts(texts: list[str], config: ServiceConfig, param: str) -> None:
    if not texts:
        raise APIError(400, f"{param} must not be an empty list", param)
    if len(texts) > config.max_batch_texts:
        raise APIError(400, f"{param} has {len(texts)} items; the limit is {config.max_batch_texts}", param)
    for i, text in enumerate(texts):
        if not text.strip():
            raise APIError(400, f"{param} item {i} is empty", param)
        if len(text) > config.max_text_chars:
            raise APIError(400, f"{param} item {i} has {len(text)} characters; the limit is {config.max_text_chars}", param)


async def translate_all(backends: Backends, config: ServiceConfig, texts: list[str], options: dict[str, Any]) -> list[dict[str, Any]]:
    """Final items (text, alternatives, token counts) of each sentence, in order. Every sentence is
    admitted before any result is awaited; if one is refused, the others are cancelled."""
    streams = await asyncio.gather(
        *(open_stream(backends.translator, {**options, "text": t}, config.retry_after_seconds) for t in texts), return_exceptions=True
    )
    failure = next((s for s in streams if isinstance(s, BaseException)), None)
    if failure is not None:
        for s in streams:
            if not isinstance(s, BaseException):
                await s.aclose()
        raise failure

    async def final(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
        text = ""
        async for item in stream:
            if item.get("error"):
                raise APIError(500, "internal error during translation", counted=True)  # the replica counted it
            text += item["text"]
            if item["finish_reason"] is not None:
                return {**item, "text": text}
        raise APIError(500, "translation ended without a result")

    tasks = [asyncio.ensure_future(final(s)) for s in streams]  # type: ignore[arg-type]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one sentence failed: the others stop using the model
            task.cancel()
        raise


@router.post("/v1/translate", tags=["translation"], responses=ERROR_RESPONSES)
async def translate(body: TranslateRequest, request: Request) -> Any:
    """English -> German. Beam search with n-best `alternatives`; `stream: true` (greedy, one text)
    answers with server-sent events."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    texts = body.text if isinstance(body.text, list) else [body.text]
    check_texts(texts, config, "text")
    if body.model is not None and body.model != config.translator.name:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")
    beam_size = body.beam_size or (1 if body.stream else max(config.default_beam_size, body.alternatives + 1))
    if body.alternatives >= beam_size:
        raise APIError(400, f"alternatives must be below beam_size ({beam_size})", "alternatives")
    options = {
        "beam_size": beam_size,
        "n_best": body.alternatives + 1,
        "length_penalty": body.length_penalty,
        "max_tokens": body.max_tokens,
    }
    if body.stream:
        if len(texts) != 1 or beam_size != 1:
            raise APIError(400, "stream needs one text and beam_size 1", "stream")
        stream = await open_stream(backends.translator, {**options, "text": texts[0], "stream": True}, config.retry_after_seconds)
        return StreamingResponse(stream_translation(stream), media_type="text/event-stream")
    results = await translate_all(backends, config, texts, options)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    completion_tokens = sum(r["completion_tokens"] for r in results)
    return {
        "model": config.translator.name,
        "translations": [
            {"text": r["text"], "alternatives": r["alternatives"] or [], "finish_reason": r["finish_reason"]} for r in results
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def stream_translation(stream: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for item in stream:
        if item.get("error"):
            yield sse({"error": {"message": "internal error during translation", "type": "internal_error", "param": None, "code": 500}})
            break
        frame: dict[str, Any] = {"text": item["text"], "finish_reason": item["finish_reason"]}
        if item["finish_reason"] is not None:
            frame["usage"] = {"prompt_tokens": item["prompt_tokens"], "completion_tokens": item["completion_tokens"]}
        if item["text"] or item["finish_reason"] is not None:
            yield sse(frame)
    yield sse("[DONE]")


LIBRETRANSLATE_BODY = {
    "requestBody": {
        "content": {
            "application/json": {"schema": LibreTranslateRequest.model_json_schema()},
            "application/x-www-form-urlencoded": {"schema": LibreTranslateRequest.model_json_schema()},
        },
        "required": True,
    }
}


async def read_libretranslate_body(request: Request) -> LibreTranslateRequest:
    """LibreTranslate accepts JSON and form bodies alike."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    try:
        if content_type in ("application/x-www-form-urlencoded", "multipart/form-data"):
            if content_type == "multipart/form-data":
                form = await request.form()
                data: dict[str, Any] = {k: v for k, v in form.items() if isinstance(v, str)}
            else:
                fields = parse_qs(raw.decode("utf-8"), keep_blank_values=True)
                data = {k: (v if k == "q" and len(v) > 1 else v[0]) for k, v in fields.items()}
            if "alternatives" in data:
                data["alternatives"] = int(data["alternatives"])
        else:
            data = json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not allowed")))
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object or a form")
        return LibreTranslateRequest.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"Invalid request: {field}: {first['msg']}", field) from None
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "Invalid request: the body is not valid JSON or form data") from None


@router.post(
    "/translate",
    tags=["libretranslate"],
    responses={400: {"description": "Invalid request"}, 429: {"description": "Overloaded"}},
    openapi_extra=LIBRETRANSLATE_BODY,
)
async def libretranslate(request: Request) -> dict[str, Any]:
    """LibreTranslate's translate: `alternatives` are the beam's n-best."""
    config: ServiceConfig = request.app.state.config
    body = await read_libretranslate_body(request)
    if body.source not in ("en", "auto") or body.target != "de":
        raise APIError(400, f"{body.source} -> {body.target} is not supported; this server translates en -> de")
    texts = body.q if isinstance(body.q, list) else [body.q]
    check_texts(texts, config, "q")
    beam_size = max(config.default_beam_size, body.alternatives + 1)
    options = {"beam_size": beam_size, "n_best": body.alternatives + 1}
    results = await translate_all(request.app.state.backends, config, texts, options)
    answer: dict[str, Any]
    if isinstance(body.q, list):
        answer = {"translatedText": [r["text"] for r in results]}
        if body.alternatives:
            answer["alternatives"] = [r["alternatives"] or [] for r in results]
    else:
        answer = {"translatedText": results[0]["text"]}
        if body.alternatives:
            answer["alternatives"] = results[0]["alternatives"] or []
    if body.source == "auto":
        # Only English is served as a source: no detection is run.
        detected = {"confidence": 100.0, "language": "en"}
        answer["detectedLanguage"] = [detected] * len(texts) if isinstance(body.q, list) else detected
    return answer


@router.get("/languages", tags=["libretranslate"])
async def languages() -> list[dict[str, Any]]:
    return LANGUAGES
