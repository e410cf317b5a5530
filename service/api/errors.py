"""Errors in the shapes clients know: OpenAI's envelope under /v1, LibreTranslate's {"error": ...}
elsewhere. Validation is 400 and names the parameter; nothing echoes the input back."""

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.schemas import LibreTranslateError, OpenAIError, OpenAIErrorDetail

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """counted: a model replica has already counted this failure (a refusal, or an engine error)."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None, counted: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after, self.counted = status, message, param, retry_after, counted


def route_path(scope: Mapping[str, Any]) -> str:
    """The request's path within this app: without the prefix the app is mounted at (Serve's
    route_prefix arrives as root_path)."""
    path: str = scope["path"]
    return path.removeprefix(scope.get("root_path", "")) or "/"


FailureHook = Callable[[str, str], None]  # (request path, failure reason) for requests refused here


VLLM_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's, beside the OpenAI routes: OpenAI's envelope


def uses_openai_errors(path: str) -> bool:
    return path.startswith("/v1/") or path in VLLM_PATHS


def error_response(path: str, status: int, message: str, param: str | None = None, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body: OpenAIError | LibreTranslateError
    if uses_openai_errors(path):
        kind = ERROR_TYPES.get(status, "internal_error")
        body = OpenAIError(error=OpenAIErrorDetail(message=message, type=kind, param=param, code=status))
    else:
        body = LibreTranslateError(error=message)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _param(location: tuple[Any, ...]) -> str:
    """("body", "stop", 2) -> "stop.2" (the field path without where it came from)."""
    # A union's members appear in the location by their type (e.g. "list[int]"): not a field's name.
    fields = [str(p) for p in location if p not in ("body", "query", "form")]
    return ".".join(p for p in fields if not any(c in p for c in "[(")) or "body"


def install_error_handlers(app: FastAPI, on_failure: FailureHook | None = None) -> None:
    def count(request: Request, reason: str) -> None:
        if on_failure is not None:
            on_failure(route_path(request.scope), reason)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        if not error.counted:
            count(request, "validation" if error.status < 500 else "internal")
        return error_response(route_path(request.scope), error.status, error.message, error.param, error.retry_after)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        count(request, "validation")
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        param = _param(tuple(first.get("loc", ())))
        message = f"{param}: {first.get('msg', 'invalid value')}"  # the message only, never the input
        return error_response(route_path(request.scope), 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(route_path(request.scope), error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        count(request, "internal")
        return error_response(route_path(request.scope), 500, "internal error")
