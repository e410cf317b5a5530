"""`POST /v1/translate`: sentence by sentence (service/api/translation.py), with the translator the
request names (`model`) or whose languages it asks for."""

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from decoding.sampling_params import GREEDY
from service.api.backend import MODEL_EXTENSION, Backends, ModelBackend, attention_map, ended_in_failure, failed, open_stream, open_streams
from service.api.errors import APIError
from service.api.routing import translator_for
from service.api.schemas import MODEL_ERRORS, TranslateChunk, TranslateRequest, TranslateResponse, event_stream
from service.api.sentences import Span
from service.api.streams import DONE, sse, sse_error
from service.api.translation import (
    TextTranslation,
    check_size,
    plain_text,
    split_texts,
    translate_documents,
    usage,
)
from service.config import ServiceConfig
from service.protocol import AttentionMap, AttentionRequest, Chunk, GenerateRequest

router = APIRouter()


@router.post(
    "/v1/translate",
    tags=["translation"],
    response_model=TranslateResponse,
    response_model_exclude_unset=True,  # a sentence's attention only with return_attention
    responses={**MODEL_ERRORS, **event_stream(TranslateChunk)},
    openapi_extra={MODEL_EXTENSION: "translator"},
)
async def translate(body: TranslateRequest, request: Request) -> Any:
    """Translation sentence by sentence, by `model` or by `source_lang` / `target_lang` (`"auto"`:
    the source detected among the languages served). Beam search with n-best `alternatives`;
    `format: "html"` translates the text of HTML documents and keeps their markup; `stream: true`
    (greedy, one text) answers with server-sent events, sentence after sentence in order."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    texts = body.text if isinstance(body.text, list) else [body.text]
    beam_size = body.beam_size or (1 if body.stream else max(config.default_beam_size, body.alternatives + 1))
    if body.alternatives >= beam_size:
        raise APIError(400, f"alternatives must be below beam_size ({beam_size})", "alternatives")
    if body.stream and (len(texts) != 1 or beam_size != 1 or body.format != "text"):
        raise APIError(400, "stream needs one text, format text and beam_size 1", "stream")
    if body.return_attention and (body.stream or body.format != "text"):
        raise APIError(400, "return_attention needs format text and no stream", "return_attention")
    template = GenerateRequest(
        text="",
        max_tokens=body.max_tokens,  # per sentence
        sampling=GREEDY,
        beam_size=beam_size,
        n_best=body.alternatives + 1,
        length_penalty=body.length_penalty,
        stream=body.stream,
    )
    check_size(texts, config, "text")
    detect_text = "\n".join(plain_text(t, body.format) for t in texts) if body.source_lang == "auto" else ""
    model, _ = translator_for(config, body.model, body.source_lang, body.target_lang, detect_text, ("source_lang", "target_lang"))
    backend = backends.models[model.name]
    if body.stream:
        spans = split_texts(texts, config, "text")[0]
        sentences = [texts[0][s.start : s.end] for s in spans]

        def open_sentence(sentence: str) -> Awaitable[AsyncGenerator[Chunk, None]]:
            return open_stream(backend, replace(template, text=sentence), config.retry_after_seconds)

        first_requests = [replace(template, text=s) for s in sentences[: config.sentences_in_flight]]
        first = await open_streams(backend, first_requests, config.retry_after_seconds)
        return StreamingResponse(stream_sentences(texts[0], spans, first, open_sentence), media_type="text/event-stream")
    if body.return_attention:
        count = sum(len(spans) for spans in split_texts(texts, config, "text"))
        if count > config.max_attention_sentences:
            limit = config.max_attention_sentences
            raise APIError(400, f"return_attention is limited to {limit} sentences per request; this has {count}", "return_attention")
    results = await translate_documents(backend, config, texts, body.format, template, "text")
    maps = await attention_maps(backend, config, texts, results) if body.return_attention else {}
    return {
        "model": model.name,
        "translations": [
            {
                "text": r.text,
                "alternatives": r.alternatives,
                "finish_reason": r.finish_reason,
                "sentences": [
                    {
                        "source": [s.span.start, s.span.end],
                        "text": s.result.text,
                        "alternatives": list(s.result.alternatives),
                        "finish_reason": s.result.finish_reason,
                        **({"attention": maps[i, j]} if maps else {}),
                    }
                    for j, s in enumerate(r.sentences)
                ],
            }
            for i, r in enumerate(results)
        ],
        "usage": usage(results),
    }


async def attention_maps(
    backend: ModelBackend, config: ServiceConfig, texts: list[str], results: list[TextTranslation]
) -> dict[tuple[int, int], dict[str, Any]]:
    """Cross-attention of each sentence's best translation, by (text, sentence) index."""
    keys, requests = [], []
    for i, (text, result) in enumerate(zip(texts, results, strict=True)):
        for j, s in enumerate(result.sentences):
            keys.append((i, j))
            requests.append(AttentionRequest(text[s.span.start : s.span.end], s.result.text))
    maps = await asyncio.gather(*(attention_map(backend, r, config.retry_after_seconds) for r in requests))
    return {key: attention_json(m) for key, m in zip(keys, maps, strict=True)}


def attention_json(attention: AttentionMap) -> dict[str, Any]:
    return {
        "source_tokens": list(attention.source_tokens),
        "target_tokens": list(attention.target_tokens),
        "layers": len(attention.weights),
        "heads": len(attention.weights[0]),
        "weights": attention.weights,
    }


async def stream_sentences(
    text: str,
    spans: list[Span],
    opened: list[AsyncGenerator[Chunk, None]],
    open_sentence: Callable[[str], Awaitable[AsyncGenerator[Chunk, None]]],
) -> AsyncIterator[str]:
    """The sentences' streams one after the other, with the text's whitespace between them. The
    first len(opened) sentences are already admitted; each later one is submitted when a sentence
    ahead of it finishes, so as many stay in flight. The last frame carries the finish reason
    ("length" if any sentence was cut) and the usage; a later refusal or failure sends an error
    frame instead."""
    streams, next_to_open = deque(opened), len(opened)
    position, prompt_tokens, completion_tokens, reason = 0, 0, 0, "stop"
    try:
        for i, span in enumerate(spans):
            stream = streams.popleft()
            prefix, position = text[position : span.start], span.end
            async for chunk in stream:
                if failed(chunk):
                    raise ended_in_failure(chunk, "translation")
                piece, prefix = prefix + chunk.text, ""
                frame: dict[str, Any] = {"text": piece, "finish_reason": None}
                if chunk.finish_reason is not None:
                    prompt_tokens += chunk.prompt_tokens
                    completion_tokens += chunk.completion_tokens
                    reason = "length" if chunk.finish_reason == "length" else reason
                    if i == len(spans) - 1:
                        frame = {"text": piece + text[position:], "finish_reason": reason}
                        frame["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
                if frame["text"] or frame["finish_reason"] is not None:
                    yield sse(TranslateChunk, frame)
            await stream.aclose()
            if next_to_open < len(spans):
                upcoming = spans[next_to_open]
                streams.append(await open_sentence(text[upcoming.start : upcoming.end]))
                next_to_open += 1
    except APIError as error:
        yield sse_error(error.message, error.status)
    finally:
        for stream in streams:
            await stream.aclose()
    yield DONE
