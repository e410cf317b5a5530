"""What the routes share for answering: server-sent events, and their error event."""

import json
from typing import Any


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json or text>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_error(message: str, status: int) -> str:
    """An error event in OpenAI's envelope, sent when a stream fails after its 200: a 503 (its
    replica was lost, or a deadline passed) is a "server_error" that may be retried."""
    kind = {429: "rate_limit_error", 503: "server_error"}.get(status, "internal_error")
    return sse({"error": {"message": message, "type": kind, "param": None, "code": status}})
