"""What the routes share for answering: server-sent events and the documented error responses."""

import json
from typing import Any

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request; `error.param` names the field"},
    404: {"description": "Unknown model"},
    413: {"description": "Body too large"},
    429: {"description": "Engine queue full; retry after `Retry-After` seconds"},
    503: {"description": "No replica available or the service is overloaded (Ray Serve)"},
}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json or text>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_error(message: str, status: int) -> str:
    """An error event in OpenAI's envelope, sent when a stream fails after its 200."""
    kind = "rate_limit_error" if status == 429 else "internal_error"
    return sse({"error": {"message": message, "type": kind, "param": None, "code": status}})
