"""Typed engine errors; the HTTP layer maps each to a status code once."""


class EngineError(Exception):
    """Base class of errors the engine raises to its callers."""


class QueueFullError(EngineError):
    """The waiting queue is at its limit; nothing was done for the request (retry later)."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (too long, bad parameter)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(EngineError):
    """The step loop is not running."""
