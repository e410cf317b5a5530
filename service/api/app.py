"""The FastAPI application: routes, error handlers, body limit, request ids, access log, API
keys and CORS."""

import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import libretranslate_routes, openai_routes, playground_routes, responses_routes, translation_routes
from service.api.auth import ApiKeyMiddleware
from service.api.backend import Backends, model_of_path
from service.api.errors import FailureHook, error_response, install_error_handlers, route_path
from service.api.response_store import ResponseStore
from service.api.schemas import Health, Readiness
from service.config import ServiceConfig

log = logging.getLogger(__name__)


class EdgeMiddleware:
    """Refuses bodies over max_bytes with 413 (counting streamed bytes, not trusting Content-Length)
    and tags every response with an X-Request-Id: the request's own (Ray Serve's proxy sets one and
    echoes it on the response itself), or a new one. Writes one access line per request to
    access_log: request id, method, path, status, body bytes read and sent, milliseconds to the
    response's end; never a query string, a body or a header."""

    def __init__(self, app: ASGIApp, max_bytes: int, access_log: logging.Logger) -> None:
        self.app, self.max_bytes, self.access_log = app, max_bytes, access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        echoed = b"x-request-id" in headers  # whoever set it puts it on the response
        request_id = headers.get(b"x-request-id") or uuid.uuid4().hex.encode()
        began = time.perf_counter()
        too_large = False
        received = sent = 0
        status = 500  # if the app raises before answering, the server answers 500
        path = route_path(scope)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            too_large = True

        async def limited_receive() -> Message:
            nonlocal received, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        started = False

        async def tagged_send(message: Message) -> None:
            nonlocal started, status, sent
            if too_large:
                return  # the app's own answer to a cut body is replaced by the 413 below
            sent += len(message.get("body", b""))
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                if not echoed:
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        try:
            if not too_large:
                try:
                    await self.app(scope, limited_receive, tagged_send)
                except Exception:
                    if not too_large:
                        raise
            if too_large and not started:
                response = error_response(path, 413, f"request body over {self.max_bytes} bytes")
                status, sent = 413, len(response.body)
                if not echoed:
                    response.headers["x-request-id"] = request_id.decode()
                await response(scope, receive, send)
        finally:
            milliseconds = (time.perf_counter() - began) * 1000
            self.access_log.info(
                "request_id=%s method=%s path=%s status=%d request_bytes=%d response_bytes=%d ms=%.1f",
                request_id.decode("latin-1"),
                scope["method"],
                scope["path"],
                status,
                received,
                sent,
                milliseconds,
            )


HEALTH_PATHS = frozenset({"/healthz", "/health", "/readyz"})


ROUTERS = (
    openai_routes.router,
    responses_routes.router,
    translation_routes.router,
    libretranslate_routes.router,
    playground_routes.router,
)


class AdmissionMiddleware:
    """Refuses at once, before reading anything, with Retry-After and the documented body: past
    max_in_flight requests at once (streams count until they end), 503; a route whose every model
    of its kind is full (`Backends.load`: as many of its requests in flight as its replicas hold,
    or its queue refused one within the last Retry-After), 429, as the full path would answer (with
    several models of a kind, the model a request names is checked once its body is read:
    service/ingress.py RayBackend). Health checks
    always pass."""

    def __init__(
        self, app: ASGIApp, config: ServiceConfig, max_in_flight: int, retry_after: int, on_failure: FailureHook | None, backends: Backends
    ) -> None:
        self.app, self.max_in_flight, self.retry_after, self.on_failure = app, max_in_flight, retry_after, on_failure
        self.load = backends.load
        self.models_of_kind = {kind: [m.name for m in config.models_of(kind)] for kind in ("translator", "generator")}
        self.model_of_path = model_of_path(ROUTERS)
        self.in_flight = 0

    async def refuse(self, scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
        path = route_path(scope)
        if self.on_failure is not None:
            self.on_failure(path, "overloaded")
        await error_response(path, status, message, retry_after=self.retry_after)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            await self.refuse(scope, receive, send, 503, "the server is busy; retry later")
            return
        kind = self.model_of_path.get(path)
        if kind is not None and self.models_of_kind[kind] and all(self.load[m].full() for m in self.models_of_kind[kind]):
            await self.refuse(scope, receive, send, 429, "the model's queue is full; retry later")
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class ServiceAPI(FastAPI):
    """FastAPI documenting only the statuses the service sends: a request that fails validation is
    answered 400 with the route's error body (service/api/errors.py), never FastAPI's 422."""

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
        return schema


def create_api(
    config: ServiceConfig, backends: Backends, on_failure: FailureHook | None = None, access_log: logging.Logger | None = None
) -> FastAPI:
    """The HTTP application over the models' backends (Ray handles in production, anything that
    streams protocol items in a test). Routes read `app.state.config` and `app.state.backends`. access_log
    takes one line per request (default: the logger "service.api.access")."""
    api = ServiceAPI(
        title="Transformer serving",
        version="0.1.0",
        description="Translation and text generation with continuous batching, for the models in the service's config.",
    )
    api.state.started = int(time.time())
    api.state.config = config
    api.state.backends = backends
    api.state.responses = ResponseStore(config.responses_store_max, config.responses_store_ttl_s)
    install_error_handlers(api, on_failure)
    # Middleware added later runs earlier: request ids, body limit and access log, then admission,
    # then CORS (a browser's preflight carries no key), then the API keys, before any route reads
    # the body.
    if config.api_keys:
        api.add_middleware(ApiKeyMiddleware, keys=[k.get_secret_value() for k in config.api_keys], on_failure=on_failure)
    if config.cors_origins:  # without it, no CORS header at all: browsers keep other origins out
        api.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    # A refused request costs no parsing, and still gets its request id and access line.
    api.add_middleware(
        AdmissionMiddleware,
        config=config,
        max_in_flight=config.ingress_max_in_flight,
        retry_after=config.retry_after_seconds,
        on_failure=on_failure,
        backends=backends,
    )
    api.add_middleware(EdgeMiddleware, max_bytes=config.max_body_bytes, access_log=access_log or logging.getLogger("service.api.access"))
    for router in ROUTERS:
        api.include_router(router)
    api.mount("/static", StaticFiles(directory=playground_routes.STATIC), name="static")

    @api.get("/healthz", tags=["health"], response_model=Health)
    async def healthz() -> dict[str, str]:
        """The ingress process is alive."""
        return {"status": "ok"}

    @api.get("/health", tags=["libretranslate"], response_model=Health)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get(
        "/readyz",
        tags=["health"],
        response_model=Readiness,
        responses={503: {"model": Readiness, "description": "A model is not loaded and warmed yet"}},
    )
    async def readyz() -> dict[str, str] | JSONResponse:
        """Every model loaded and warmed (their replicas answer)."""
        try:
            ready = all([await backend.ready() for backend in backends.models.values()])
        except Exception:
            log.exception("readiness check failed")
            ready = False
        if not ready:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return {"status": "ready"}

    return api
