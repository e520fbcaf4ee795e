"""HTTP errors in vLLM's nested OpenAI form, and the status of each way a request can fail."""

from __future__ import annotations

import msgspec

__all__ = ["ApiError", "ERROR_TYPES", "error_type", "failure_status", "error_body"]

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeoutError", 409: "ConflictError",
               410: "GoneError", 413: "BadRequestError", 422: "UnprocessableEntityError", 429: "RateLimitError",
               500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
               504: "GatewayTimeoutError"}
"""The error ``type`` of each status kvemu answers with (OpenAI's client names where it has one)."""


def error_type(status: int) -> str:
    """``status``'s error type; one without its own is a client's (``BadRequestError``) or the server's
    (``InternalServerError``) fault by its class, never a 4xx typed as the server's."""
    return ERROR_TYPES.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")

# a failed request's recorded reason (``RequestRecord.failure``), by prefix, as the status a client gets
_FAILURE_STATUS = (
    ("invalid_request", 400),
    ("invalid_argument", 400),  # e.g. a session id longer than the affinity table takes
    ("pinned_worker_not_allowed", 400),
    ("duplicate_request_id", 400),
    ("unknown_dp_rank", 400),
    ("queue_rejected", 429),
    ("do_not_queue", 429),
    ("encode_failed", 500),  # kvemu could not send what it accepted: its own failure, not the worker's
    ("send_failed", 500),
    ("engine_error", 500),  # an engine pass failed on this request's rank (workers.actor.actor.WorkerActor.fault)
)


class ApiError(Exception):
    """A request the front end answers with an error status; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def body(self) -> bytes:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's error object for ``status``."""
    return msgspec.json.encode({"error": {"message": message, "type": error_type(status),
                                          "param": param, "code": status}})


def failure_status(failure: str) -> int:
    """The HTTP status of a request that ended with ``failure`` before producing anything: 400 for what the
    client asked wrongly, 429 when the policy queue turned it away, 500 when kvemu itself could not send it,
    503 when no worker could serve it."""
    for prefix, status in _FAILURE_STATUS:
        if failure.startswith(prefix):
            return status
    return 503
