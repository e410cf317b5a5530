"""The FastAPI application: routes, error handlers, body limit and request ids."""

import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import libretranslate_routes, openai_routes, playground_routes, translation_routes
from service.api.backend import Backends
from service.api.errors import FailureHook, error_response, install_error_handlers
from service.config import ServiceConfig

log = logging.getLogger(__name__)


class EdgeMiddleware:
    """Refuses bodies over max_bytes with 413 (counting streamed bytes, not trusting Content-Length)
    and tags every response with an X-Request-Id: the request's own (Ray Serve's proxy sets one and
    echoes it on the response itself), or a new one."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        echoed = b"x-request-id" in headers  # whoever set it puts it on the response
        request_id = uuid.uuid4().hex.encode()
        too_large = False
        received = 0
        path = scope["path"]
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
            nonlocal started
            if too_large:
                return  # the app's own answer to a cut body is replaced by the 413 below
            if message["type"] == "http.response.start":
                started = True
                if not echoed:
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        if not too_large:
            try:
                await self.app(scope, limited_receive, tagged_send)
            except Exception:
                if not too_large:
                    raise
        if too_large and not started:
            response = error_response(path, 413, f"request body over {self.max_bytes} bytes")
            if not echoed:
                response.headers["x-request-id"] = request_id.decode()
            await response(scope, receive, send)


def create_api(config: ServiceConfig, backends: Backends, on_failure: FailureHook | None = None) -> FastAPI:
    """The HTTP application over two model backends (Ray handles in production, anything that
    streams dicts in a test). Routes read `app.state.config` and `app.state.backends`."""
    api = FastAPI(
        title="Transformer serving",
        version="0.1.0",
        description="English -> German translation and Shakespeare generation with continuous batching.",
    )
    api.state.started = int(time.time())
    api.state.config = config
    api.state.backends = backends
    install_error_handlers(api, on_failure)
    api.add_middleware(EdgeMiddleware, max_bytes=config.max_body_bytes)
    api.include_router(openai_routes.router)
    api.include_router(translation_routes.router)
    api.include_router(libretranslate_routes.router)
    api.include_router(playground_routes.router)
    api.mount("/static", StaticFiles(directory=playground_routes.STATIC), name="static")

    @api.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The ingress process is alive."""
        return {"status": "ok"}

    @api.get("/health", tags=["libretranslate"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz", tags=["health"], responses={503: {"description": "A model is not loaded and warmed yet"}})
    async def readyz() -> Any:
        """Both models loaded and warmed (their replicas answer)."""
        try:
            ready = await backends.translator.ready() and await backends.generator.ready()
        except Exception:
            log.exception("readiness check failed")
            ready = False
        if not ready:
            return JSONResponse({"status": "not ready"}, status_code=503)
        return {"status": "ready"}

    return api
