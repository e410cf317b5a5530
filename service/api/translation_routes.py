"""Translation: `POST /v1/translate` and LibreTranslate's `/translate`, `/detect`, `/languages`
and `/frontend/settings`.

Every text is split into sentences (service/api/sentences.py); every sentence becomes one engine
request, all submitted together, so they batch with each other and with other clients' sentences
at every decode step. The translations are joined back around the text's own whitespace; with
`format: "html"` only the document's text is translated (service/api/html_text.py).
"""

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from service.api.backend import Backends, open_stream
from service.api.errors import APIError
from service.api.html_text import HtmlDocument
from service.api.language_id import LANGUAGE_NAMES, detect_languages, foreign_language
from service.api.openai_routes import ERROR_RESPONSES, sse
from service.api.schemas import DetectRequest, LibreTranslateRequest, TranslateRequest
from service.api.sentences import Span, join_translations, split_sentences
from service.config import ServiceConfig

router = APIRouter()

LANGUAGES = [{"code": "en", "name": "English", "targets": ["de"]}, {"code": "de", "name": "German", "targets": []}]


@dataclass(frozen=True)
class SentenceTranslation:
    span: Span  # where the sentence is in its text
    text: str
    alternatives: list[str]  # beam search's next best, best first; empty for greedy
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TextTranslation:
    """One text (or one HTML document) translated sentence by sentence."""

    text: str
    alternatives: list[str]  # alternative i of the text: alternative i of each sentence that has one
    sentences: list[SentenceTranslation]

    @property
    def finish_reason(self) -> str:
        """ "length" when any sentence was cut by max_tokens: the response says so."""
        return "length" if any(s.finish_reason == "length" for s in self.sentences) else "stop"


def joined(text: str, sentences: Sequence[SentenceTranslation], alternative: int | None = None) -> str:
    """text rebuilt around its sentences' translations (alternative i where a sentence has one)."""

    def pick(s: SentenceTranslation) -> str:
        return s.alternatives[alternative] if alternative is not None and alternative < len(s.alternatives) else s.text

    return join_translations(text, [s.span for s in sentences], [pick(s) for s in sentences])


def check_size(texts: list[str], config: ServiceConfig, param: str) -> None:
    """The request's limits on items and characters, on the texts as sent."""
    if not texts:
        raise APIError(400, f"{param} must not be an empty list", param)
    if len(texts) > config.max_batch_texts:
        raise APIError(400, f"{param} has {len(texts)} items; the limit is {config.max_batch_texts}", param)
    for i, text in enumerate(texts):
        if not text.strip():
            raise APIError(400, f"{param} item {i} is empty" if len(texts) > 1 else f"{param} is empty", param)
    characters = sum(len(t) for t in texts)
    if characters > config.max_translate_chars:
        raise APIError(400, f"{param} has {characters} characters; the limit is {config.max_translate_chars} per request", param)


def split_texts(texts: list[str], config: ServiceConfig, param: str) -> list[list[Span]]:
    """The sentences of each text, with the request's limit on sentences checked on the whole."""
    spans = [split_sentences(t, config.max_sentence_chars) for t in texts]
    sentences = sum(len(s) for s in spans)
    if sentences > config.max_translate_sentences:
        raise APIError(400, f"{param} has {sentences} sentences; the limit is {config.max_translate_sentences} per request", param)
    return spans


def plain_text(document: str, text_format: Literal["text", "html"]) -> str:
    """What the translator would see of a document."""
    return document if text_format == "text" else "\n".join(HtmlDocument.parse(document).block_texts())


def refuse_foreign_text(texts: list[str], param: str) -> None:
    """source "auto": text in another language than English is a 400 naming that language."""
    detected = foreign_language("\n".join(texts))
    if detected is not None:
        name = LANGUAGE_NAMES[detected.language]
        raise APIError(
            400,
            f"the text looks {name} ({detected.language}, confidence {detected.confidence:.0%}); this server translates "
            "English to German only (send the source language as en to translate it anyway)",
            param,
        )


async def open_sentences(
    backends: Backends, config: ServiceConfig, sentences: list[str], options: dict[str, Any]
) -> list[AsyncIterator[dict[str, Any]]]:
    """One admitted stream per sentence, all admitted before any result is awaited; if one is
    refused, the others are closed (cancelled) and the refusal is raised."""
    streams = await asyncio.gather(
        *(open_stream(backends.translator, {**options, "text": s}, config.retry_after_seconds) for s in sentences), return_exceptions=True
    )
    failure = next((s for s in streams if isinstance(s, BaseException)), None)
    if failure is not None:
        for s in streams:
            if not isinstance(s, BaseException):
                await s.aclose()
        raise failure
    return streams  # type: ignore[return-value]


async def final_item(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """A sentence's last item with the whole text; the stream is closed (cancelled) on the way out."""
    text = ""
    try:
        async for item in stream:
            if item.get("error"):
                raise APIError(500, "internal error during translation", counted=True)  # the replica counted it
            text += item["text"]
            if item["finish_reason"] is not None:
                return {**item, "text": text}
        raise APIError(500, "translation ended without a result")
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def translate_texts(
    backends: Backends, config: ServiceConfig, texts: list[str], spans: list[list[Span]], options: dict[str, Any]
) -> list[TextTranslation]:
    """Each text translated sentence by sentence: up to `sentences_in_flight` sentences of the
    request in the engine at once (a long text must not fill a replica's queue by itself). The
    first refusal or failure cancels the rest and is raised."""
    sentences = [text[s.start : s.end] for text, text_spans in zip(texts, spans, strict=True) for s in text_spans]
    window = asyncio.Semaphore(config.sentences_in_flight)

    async def translate_one(sentence: str) -> dict[str, Any]:
        async with window:
            stream = await open_stream(backends.translator, {**options, "text": sentence}, config.retry_after_seconds)
            return await final_item(stream)

    tasks = [asyncio.ensure_future(translate_one(s)) for s in sentences]
    try:
        results = iter(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one sentence failed: the others stop using the model
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    translations = []
    for text, text_spans in zip(texts, spans, strict=True):
        done = [
            SentenceTranslation(span, r["text"], r["alternatives"] or [], r["finish_reason"], r["prompt_tokens"], r["completion_tokens"])
            for span, r in zip(text_spans, results, strict=False)
        ]
        n_alternatives = max((len(s.alternatives) for s in done), default=0)
        alternatives = [joined(text, done, i) for i in range(n_alternatives)]
        translations.append(TextTranslation(joined(text, done), alternatives, done))
    return translations


async def translate_documents(
    backends: Backends,
    config: ServiceConfig,
    documents: list[str],
    text_format: Literal["text", "html"],
    options: dict[str, Any],
    param: str,
) -> list[TextTranslation]:
    """Texts, or HTML documents whose text is translated and markup kept. Limits are checked on
    the documents as sent (items, characters: `check_size`, called first) and on what is
    translated (sentences)."""
    if text_format == "text":
        return await translate_texts(backends, config, documents, split_texts(documents, config, param), options)
    parsed = [HtmlDocument.parse(d) for d in documents]
    blocks = [b for doc in parsed for b in doc.block_texts()]
    translated = iter(await translate_texts(backends, config, blocks, split_texts(blocks, config, param), options))
    results = []
    for doc in parsed:
        done = [next(translated) for _ in doc.blocks]
        html = doc.render([[(s.span, s.text) for s in block.sentences] for block in done])
        results.append(TextTranslation(html, [], [s for block in done for s in block.sentences]))
    return results


def usage(translations: Sequence[TextTranslation]) -> dict[str, int]:
    prompt_tokens = sum(s.prompt_tokens for t in translations for s in t.sentences)
    completion_tokens = sum(s.completion_tokens for t in translations for s in t.sentences)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


@router.post("/v1/translate", tags=["translation"], responses=ERROR_RESPONSES)
async def translate(body: TranslateRequest, request: Request) -> Any:
    """English -> German, sentence by sentence. Beam search with n-best `alternatives`;
    `format: "html"` translates the text of HTML documents and keeps their markup; `stream: true`
    (greedy, one text) answers with server-sent events, sentence after sentence in order."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    texts = body.text if isinstance(body.text, list) else [body.text]
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
    if body.stream and (len(texts) != 1 or beam_size != 1 or body.format != "text"):
        raise APIError(400, "stream needs one text, format text and beam_size 1", "stream")
    check_size(texts, config, "text")
    if body.stream:
        spans = split_texts(texts, config, "text")
        if body.source_lang == "auto":
            refuse_foreign_text(texts, "source_lang")
        sentences = [texts[0][s.start : s.end] for s in spans[0]]

        def open_sentence(sentence: str) -> Awaitable[AsyncIterator[dict[str, Any]]]:
            return open_stream(backends.translator, {**options, "text": sentence, "stream": True}, config.retry_after_seconds)

        first = await open_sentences(backends, config, sentences[: config.sentences_in_flight], {**options, "stream": True})
        return StreamingResponse(stream_sentences(texts[0], spans[0], first, open_sentence), media_type="text/event-stream")
    if body.source_lang == "auto":
        refuse_foreign_text([plain_text(t, body.format) for t in texts], "source_lang")
    results = await translate_documents(backends, config, texts, body.format, options, "text")
    return {
        "model": config.translator.name,
        "translations": [
            {
                "text": r.text,
                "alternatives": r.alternatives,
                "finish_reason": r.finish_reason,
                "sentences": [
                    {"source": [s.span.start, s.span.end], "text": s.text, "alternatives": s.alternatives, "finish_reason": s.finish_reason}
                    for s in r.sentences
                ],
            }
            for r in results
        ],
        "usage": usage(results),
    }


async def stream_sentences(
    text: str,
    spans: list[Span],
    opened: list[AsyncIterator[dict[str, Any]]],
    open_sentence: Callable[[str], Awaitable[AsyncIterator[dict[str, Any]]]],
) -> AsyncIterator[str]:
    """The sentences' streams one after the other, with the text's whitespace between them. The
    first len(opened) sentences are already admitted; each later one is submitted when a sentence
    ahead of it finishes, so as many stay in flight. The last frame carries the finish reason
    ("length" if any sentence was cut) and the usage; a later refusal or failure ends the stream
    with an error frame and no [DONE]."""
    streams, next_to_open = deque(opened), len(opened)
    position, prompt_tokens, completion_tokens, reason = 0, 0, 0, "stop"
    try:
        for i, span in enumerate(spans):
            stream = streams.popleft()
            prefix, position = text[position : span.start], span.end
            async for item in stream:
                if item.get("error"):
                    raise APIError(500, "internal error during translation", counted=True)
                piece, prefix = prefix + item["text"], ""
                frame: dict[str, Any] = {"text": piece, "finish_reason": None}
                if item["finish_reason"] is not None:
                    prompt_tokens += item["prompt_tokens"]
                    completion_tokens += item["completion_tokens"]
                    reason = "length" if item["finish_reason"] == "length" else reason
                    if i == len(spans) - 1:
                        frame = {"text": piece + text[position:], "finish_reason": reason}
                        frame["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
                if frame["text"] or frame["finish_reason"] is not None:
                    yield sse(frame)
            await stream.aclose()  # type: ignore[attr-defined]
            if next_to_open < len(spans):
                upcoming = spans[next_to_open]
                streams.append(await open_sentence(text[upcoming.start : upcoming.end]))
                next_to_open += 1
        yield sse("[DONE]")
    except APIError as error:
        kind = "rate_limit_error" if error.status == 429 else "internal_error"
        yield sse({"error": {"message": error.message, "type": kind, "param": None, "code": error.status}})
    finally:
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def libretranslate_body(schema: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a LibreTranslate route: JSON, urlencoded form or multipart form."""
    content = {
        kind: {"schema": schema.model_json_schema()}
        for kind in ("application/json", "application/x-www-form-urlencoded", "multipart/form-data")
    }
    return {"requestBody": {"content": content, "required": True}}


Body = TypeVar("Body", bound=BaseModel)


async def read_libretranslate_body(request: Request, schema: type[Body]) -> Body:
    """LibreTranslate accepts JSON, urlencoded and multipart form bodies alike; a repeated form
    field `q` is a list."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        data: Any
        if content_type == "multipart/form-data":
            form = await request.form()
            data = {k: [v for v in form.getlist(k) if isinstance(v, str)] for k in form}
            data = {k: (v if k == "q" and len(v) > 1 else v[0]) for k, v in data.items() if v}
        elif content_type == "application/x-www-form-urlencoded":
            fields = parse_qs((await request.body()).decode("utf-8"), keep_blank_values=True)
            data = {k: (v if k == "q" and len(v) > 1 else v[0]) for k, v in fields.items()}
        else:
            data = json.loads(await request.body(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not allowed")))
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object or a form")
        if content_type != "application/json" and "alternatives" in data:
            data["alternatives"] = int(data["alternatives"])
        return schema.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"Invalid request: {field}: {first['msg']}", field) from None
    except (ValueError, UnicodeDecodeError, AssertionError):
        raise APIError(400, "Invalid request: the body is not valid JSON or form data") from None


@router.post(
    "/translate",
    tags=["libretranslate"],
    responses={400: {"description": "Invalid request"}, 429: {"description": "Overloaded"}},
    openapi_extra=libretranslate_body(LibreTranslateRequest),
)
async def libretranslate(request: Request) -> dict[str, Any]:
    """LibreTranslate's translate: text or HTML, one or a list; `alternatives` are the beam's n-best."""
    config: ServiceConfig = request.app.state.config
    body = await read_libretranslate_body(request, LibreTranslateRequest)
    if body.source not in ("en", "auto") or body.target != "de":
        raise APIError(400, f"{body.source} -> {body.target} is not supported; this server translates en -> de")
    texts = body.q if isinstance(body.q, list) else [body.q]
    check_size(texts, config, "q")
    plain = [plain_text(t, body.format) for t in texts] if body.source == "auto" else []
    if plain:
        refuse_foreign_text(plain, "source")
    options = {"beam_size": max(config.default_beam_size, body.alternatives + 1), "n_best": body.alternatives + 1}
    results = await translate_documents(request.app.state.backends, config, texts, body.format, options, "q")
    answer: dict[str, Any]
    if isinstance(body.q, list):
        answer = {"translatedText": [r.text for r in results]}
        if body.alternatives:
            answer["alternatives"] = [r.alternatives for r in results]
    else:
        answer = {"translatedText": results[0].text}
        if body.alternatives:
            answer["alternatives"] = results[0].alternatives
    if plain:
        detected = [detect_languages(t, top=1)[0] for t in plain]
        shapes = [{"confidence": round(d.confidence * 100, 1), "language": d.language} for d in detected]
        answer["detectedLanguage"] = shapes if isinstance(body.q, list) else shapes[0]
    return answer


@router.post(
    "/detect",
    tags=["libretranslate"],
    responses={400: {"description": "Invalid request"}},
    openapi_extra=libretranslate_body(DetectRequest),
)
async def detect(request: Request) -> list[dict[str, Any]]:
    """LibreTranslate's detect: the three most probable languages, confidence in percent."""
    config: ServiceConfig = request.app.state.config
    body = await read_libretranslate_body(request, DetectRequest)
    if not body.q.strip():
        raise APIError(400, "Invalid request: q is empty", "q")
    if len(body.q) > config.max_translate_chars:
        raise APIError(400, f"q has {len(body.q)} characters; the limit is {config.max_translate_chars}", "q")
    return [{"confidence": round(d.confidence * 100, 1), "language": d.language} for d in detect_languages(body.q)]


@router.get("/languages", tags=["libretranslate"])
async def languages() -> list[dict[str, Any]]:
    return LANGUAGES


@router.get("/frontend/settings", tags=["libretranslate"])
async def frontend_settings(request: Request) -> dict[str, Any]:
    """What LibreTranslate's clients read before translating: limits and the language pair."""
    config: ServiceConfig = request.app.state.config
    return {
        "charLimit": config.max_translate_chars,
        "frontendTimeout": 500,
        "apiKeys": False,
        "keyRequired": False,
        "suggestions": False,
        "filesTranslation": False,
        "supportedFilesFormat": [],
        "language": {"source": {"code": "en", "name": "English"}, "target": {"code": "de", "name": "German"}},
    }
