"""API keys. With `ServiceConfig.api_keys` set, every route but the public ones needs one: as
`Authorization: Bearer <key>`, or on LibreTranslate's `/translate` and `/detect` also as the body's
`api_key` field (JSON, urlencoded or multipart), as LibreTranslate reads it. The key is checked
before the route runs: before the body is validated and before any model work. Keys are never
logged or echoed; a refusal says only whether a key was missing or wrong."""

import hashlib
import hmac
from collections.abc import Sequence

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import FailureHook, error_response, route_path
from service.api.libretranslate_routes import libretranslate_fields

# Served without a key: liveness and readiness; LibreTranslate's discovery routes (LibreTranslate
# serves them without one, and /frontend/settings says a key is required); the playground's page
# and assets (no data: its API calls need the key); the API's description, which the README
# publishes anyway.
PUBLIC_PATHS = frozenset(
    {"/healthz", "/health", "/readyz", "/languages", "/frontend/settings", "/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)
PUBLIC_PREFIXES = ("/static/",)
BODY_KEY_PATHS = frozenset({"/translate", "/detect"})  # LibreTranslate's: the key may be the body's api_key


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's first Authorization header if its scheme is Bearer."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return (token.strip() or None) if scheme.lower() == b"bearer" else None
    return None


async def body_api_key(scope: Scope, messages: list[Message]) -> bytes | None:
    """The `api_key` field of a LibreTranslate body already received as messages; None when the
    body has none or cannot be read."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    try:
        fields = await libretranslate_fields(Request(scope, replay))
    except (ValueError, UnicodeDecodeError, AssertionError, HTTPException):
        return None
    key = fields.get("api_key") if isinstance(fields, dict) else None
    return key.encode() if isinstance(key, str) and key else None


class ApiKeyMiddleware:
    """Refuses requests to every non-public route that carry none of `keys`: 401 with
    `WWW-Authenticate: Bearer` (OpenAI's error envelope under /v1); on LibreTranslate's routes
    400 when no key was sent and 403 when it is wrong, as LibreTranslate answers. Refusals are
    counted through on_failure as "unauthorized"."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], on_failure: FailureHook | None = None) -> None:
        self.app, self.on_failure = app, on_failure
        # Digests: every comparison is between equal lengths, so its time tells nothing of a key.
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def accepts(self, key: bytes | None) -> bool:
        """Whether key is one of the keys; compared with every key, each in constant time."""
        if not key:
            return False
        digest = hashlib.sha256(key).digest()
        return sum(hmac.compare_digest(digest, d) for d in self.digests) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websocket route is served
            await send({"type": "websocket.close", "code": 1008})
            return
        path = route_path(scope)
        bearer = bearer_token(scope)
        if is_public(path) or self.accepts(bearer):
            await self.app(scope, receive, send)
            return
        if path not in BODY_KEY_PATHS:
            text = "missing API key: send it as Authorization: Bearer <key>" if bearer is None else "invalid API key"
            await self.refuse(scope, receive, send, path, 401, text)
            return
        messages: list[Message] = []  # the whole body (at most max_body_bytes: EdgeMiddleware counts it), replayed below
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        field = await body_api_key(scope, messages)
        if self.accepts(field):

            async def replayed() -> Message:
                return messages.pop(0) if messages else await receive()

            await self.app(scope, replayed, send)
        elif bearer is None and field is None:
            await self.refuse(scope, receive, send, path, 400, "Invalid request: missing api_key parameter")
        else:
            await self.refuse(scope, receive, send, path, 403, "Invalid API key")

    async def refuse(self, scope: Scope, receive: Receive, send: Send, path: str, status: int, message: str) -> None:
        if self.on_failure is not None:
            self.on_failure(path, "unauthorized")
        response = error_response(path, status, message)
        if status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
