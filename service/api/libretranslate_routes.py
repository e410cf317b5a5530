"""LibreTranslate's API: `/translate` (text or HTML, JSON or form bodies), `/detect`,
`/languages` and `/frontend/settings`, answered as LibreTranslate answers them."""

import json
from typing import Any, TypeVar
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from decoding.sampling_params import GREEDY
from service.api.backend import MODEL_EXTENSION
from service.api.errors import APIError
from service.api.language_id import detect_languages
from service.api.routing import language_name, pairs, translator_for
from service.api.schemas import (
    DetectedLanguage,
    DetectRequest,
    FrontendSettings,
    Language,
    LibreTranslateError,
    LibreTranslateRequest,
    LibreTranslateResponse,
    error_responses,
)
from service.api.translation import check_size, plain_text, translate_documents
from service.config import ServiceConfig
from service.protocol import GenerateRequest

router = APIRouter()


def languages_served(config: ServiceConfig) -> list[dict[str, Any]]:
    """LibreTranslate's list: every language a translator reads or writes, with the targets it has."""
    targets: dict[str, list[str]] = {}
    for source, target in pairs(config):
        targets.setdefault(source, []).append(target)
        targets.setdefault(target, [])
    return [{"code": code, "name": language_name(code), "targets": to} for code, to in targets.items()]


def libretranslate_body(schema: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a LibreTranslate route: JSON, urlencoded form or multipart form."""
    content = {
        kind: {"schema": schema.model_json_schema()}
        for kind in ("application/json", "application/x-www-form-urlencoded", "multipart/form-data")
    }
    return {"requestBody": {"content": content, "required": True}}


Body = TypeVar("Body", bound=BaseModel)


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def libretranslate_fields(request: Request) -> Any:
    """The body as LibreTranslate reads it: JSON, urlencoded and multipart form bodies alike; a
    repeated form field `q` is a list. Raises ValueError (or UnicodeDecodeError, or Starlette's
    HTTPException for a broken multipart body) when it is none of them."""
    kind = content_type(request)
    if kind == "multipart/form-data":
        form = await request.form()
        data = {k: [v for v in form.getlist(k) if isinstance(v, str)] for k in form}
        return {k: (v if k == "q" and len(v) > 1 else v[0]) for k, v in data.items() if v}
    if kind == "application/x-www-form-urlencoded":
        fields = parse_qs((await request.body()).decode("utf-8"), keep_blank_values=True)
        return {k: (v if k == "q" and len(v) > 1 else v[0]) for k, v in fields.items()}
    return json.loads(await request.body(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not allowed")))


async def read_libretranslate_body(request: Request, schema: type[Body]) -> Body:
    """The body (libretranslate_fields) validated as schema; a bad field is a 400 naming it."""
    try:
        data = await libretranslate_fields(request)
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object or a form")
        if content_type(request) != "application/json" and "alternatives" in data:
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
    response_model=LibreTranslateResponse,
    response_model_exclude_unset=True,  # alternatives and detectedLanguage only when asked for
    responses=error_responses(LibreTranslateError, 400, 403, 413, 429, 500, 503),
    openapi_extra={**libretranslate_body(LibreTranslateRequest), MODEL_EXTENSION: "translator"},
)
async def libretranslate(request: Request) -> dict[str, Any]:
    """LibreTranslate's translate: text or HTML, one or a list; `alternatives` are the beam's n-best."""
    config: ServiceConfig = request.app.state.config
    body = await read_libretranslate_body(request, LibreTranslateRequest)
    texts = body.q if isinstance(body.q, list) else [body.q]
    check_size(texts, config, "q")
    plain = [plain_text(t, body.format) for t in texts] if body.source == "auto" else []
    model, detected = translator_for(config, None, body.source, body.target, "\n".join(plain), ("source", "target"))
    beam_size = max(config.default_beam_size, body.alternatives + 1)
    template = GenerateRequest(text="", sampling=GREEDY, beam_size=beam_size, n_best=body.alternatives + 1)
    results = await translate_documents(request.app.state.backends.models[model.name], config, texts, body.format, template, "q")
    answer: dict[str, Any]
    if isinstance(body.q, list):
        answer = {"translatedText": [r.text for r in results]}
        if body.alternatives:
            answer["alternatives"] = [r.alternatives for r in results]
    else:
        answer = {"translatedText": results[0].text}
        if body.alternatives:
            answer["alternatives"] = results[0].alternatives
    if detected is not None:
        ranked = [detect_languages(t) for t in plain]
        confidence = [next((d.confidence for d in r if d.language == detected), 0.0) for r in ranked]
        shapes = [{"confidence": round(c * 100, 1), "language": detected} for c in confidence]
        answer["detectedLanguage"] = shapes if isinstance(body.q, list) else shapes[0]
    return answer


@router.post(
    "/detect",
    tags=["libretranslate"],
    response_model=list[DetectedLanguage],
    responses=error_responses(LibreTranslateError, 400, 403, 413, 503),
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


@router.get("/languages", tags=["libretranslate"], response_model=list[Language], responses=error_responses(LibreTranslateError, 503))
async def languages(request: Request) -> list[dict[str, Any]]:
    return languages_served(request.app.state.config)


@router.get(
    "/frontend/settings", tags=["libretranslate"], response_model=FrontendSettings, responses=error_responses(LibreTranslateError, 503)
)
async def frontend_settings(request: Request) -> dict[str, Any]:
    """What LibreTranslate's clients read before translating: limits, the default language pair
    (the first translator's) and whether an API key is required."""
    config: ServiceConfig = request.app.state.config
    source, target = pairs(config)[0] if pairs(config) else ("auto", "auto")
    return {
        "charLimit": config.max_translate_chars,
        "frontendTimeout": 500,
        "apiKeys": bool(config.api_keys),
        "keyRequired": bool(config.api_keys),
        "suggestions": False,
        "filesTranslation": False,
        "supportedFilesFormat": [],
        "language": {"source": {"code": source, "name": language_name(source)}, "target": {"code": target, "name": language_name(target)}},
    }
