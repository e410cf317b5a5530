"""The playground page at `/` (plain HTML, CSS and JavaScript from service/api/static, nothing
fetched from elsewhere) and `POST /v1/attention`, the generator's self-attention over a text."""

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse

from service.api.backend import MODEL_EXTENSION, Backends, attention_map
from service.api.errors import APIError
from service.api.routing import model_by_name
from service.api.schemas import ERROR_DESCRIPTIONS, MODEL_ERRORS, AttentionRequestBody, LibreTranslateError, SelfAttention, inlined_schema
from service.api.translation_routes import attention_json
from service.config import ServiceConfig
from service.protocol import AttentionRequest

STATIC = Path(__file__).parent / "static"

router = APIRouter()


# The page's refusal (the ingress is full) is JSON, whatever the page's own media type.
REFUSED: dict[int | str, dict[str, Any]] = {
    503: {"description": ERROR_DESCRIPTIONS[503], "content": {"application/json": {"schema": inlined_schema(LibreTranslateError)}}}
}


@router.get("/", tags=["playground"], response_class=HTMLResponse, responses=REFUSED)
async def playground() -> FileResponse:
    """The playground page (HTML)."""
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.post(
    "/v1/attention", tags=["playground"], response_model=SelfAttention, responses=MODEL_ERRORS, openapi_extra={MODEL_EXTENSION: "generator"}
)
async def attention(body: AttentionRequestBody, request: Request) -> dict[str, Any]:
    """The generator's self-attention over `text`: `weights[layer][head][i][j]` is how much token
    i attends to token j (j <= i; each row sums to 1), from the model's explicit attention path.
    Translation attention comes with `/v1/translate` and `return_attention: true`."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    model = model_by_name(config, "generator", body.model).name
    if len(body.text) > config.max_attention_chars:
        raise APIError(400, f"text has {len(body.text)} characters; the limit is {config.max_attention_chars}", "text")
    result = await attention_map(backends.models[model], AttentionRequest(body.text), config.retry_after_seconds)
    answer = attention_json(result)
    return {
        "model": model,
        "tokens": answer.pop("source_tokens"),
        **{k: v for k, v in answer.items() if k != "target_tokens"},
    }
