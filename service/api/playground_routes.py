"""The playground page at `/` (plain HTML, CSS and JavaScript from service/api/static, nothing
fetched from elsewhere) and `POST /v1/attention`, the generator's self-attention over a text."""

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from service.api.backend import Backends, attention_map
from service.api.errors import APIError
from service.api.schemas import AttentionRequestBody
from service.api.streams import ERROR_RESPONSES
from service.api.translation_routes import attention_json
from service.config import ServiceConfig
from service.protocol import AttentionRequest

STATIC = Path(__file__).parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.post("/v1/attention", tags=["playground"], responses=ERROR_RESPONSES)
async def attention(body: AttentionRequestBody, request: Request) -> dict[str, Any]:
    """The generator's self-attention over `text`: `weights[layer][head][i][j]` is how much token
    i attends to token j (j <= i; each row sums to 1), from the model's explicit attention path.
    Translation attention comes with `/v1/translate` and `return_attention: true`."""
    config: ServiceConfig = request.app.state.config
    backends: Backends = request.app.state.backends
    if body.model is not None and body.model != config.generator.name:
        hint = " (for the translator, use /v1/translate with return_attention)" if body.model == config.translator.name else ""
        raise APIError(404, f"The model `{body.model}` does not exist{hint}.", "model")
    if len(body.text) > config.max_prompt_chars:
        raise APIError(400, f"text has {len(body.text)} characters; the limit is {config.max_prompt_chars}", "text")
    result = await attention_map(backends.generator, AttentionRequest(body.text), config.retry_after_seconds)
    answer = attention_json(result)
    return {
        "model": config.generator.name,
        "tokens": answer.pop("source_tokens"),
        **{k: v for k, v in answer.items() if k != "target_tokens"},
    }
