"""The supervisor's error hierarchy and its one mapping to HTTP statuses and OpenAI error bodies.

Every error a client can see is one of these; app.py turns them into
`{"error": {"message", "type", "param", "code"}}` with `status`.
"""

from __future__ import annotations

from protocol.messages import (
    ABORTED,
    CONTEXT_LENGTH_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MODEL_EVICTED,
    OVERLOADED,
    WORKER_CRASHED,
)


class MlxsupError(Exception):
    status = 500
    type = "server_error"
    code = INTERNAL_ERROR

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.extra: dict = {}  # more facts for the error body (what is loaded, what is missing)
        if code is not None:
            self.code = code

    retry_after_s: int | None = None  # a Retry-After header's seconds (the queue's refusals)

    def headers(self) -> dict[str, str]:
        """The response headers this error adds."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


class InvalidRequest(MlxsupError):
    status = 400
    type = "invalid_request_error"
    code = INVALID_REQUEST


class ContextLengthExceeded(InvalidRequest):
    code = CONTEXT_LENGTH_EXCEEDED


class Unauthorized(MlxsupError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(MlxsupError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class HostNotAllowed(Forbidden):
    code = "host_not_allowed"


class OriginNotAllowed(Forbidden):
    code = "origin_not_allowed"


class ModelNotFound(MlxsupError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(MlxsupError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(MlxsupError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RequestTimeout(MlxsupError):
    """The request's body was not whole within server.body_timeout_s (a stalled or slow-loris upload)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class UnsupportedMediaType(MlxsupError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class WorkerDied(MlxsupError):
    status = 502
    type = "server_error"
    code = WORKER_CRASHED


class ModelLoadFailed(MlxsupError):
    status = 503
    type = "server_error"
    code = "model_load_failed"


class ModelEvicted(MlxsupError):
    status = 503
    type = "server_error"
    code = MODEL_EVICTED


class ModelDownloading(MlxsupError):
    status = 503
    type = "server_error"
    code = "model_downloading"


class Overloaded(MlxsupError):
    """The worker cannot take the request now (its image decoders are held by decodes past their deadline)."""

    status = 503
    code = OVERLOADED


class ShuttingDown(MlxsupError):
    status = 503
    type = "server_error"
    code = "shutting_down"


class QueueFull(MlxsupError):
    """As many requests as the model's queue holds wait already (max_queued_requests): try again later."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class QueueTimeout(MlxsupError):
    """The request waited for its model as long as it may (queue_timeout_s)."""

    status = 503
    type = "server_error"
    code = "queue_timeout"


class InsufficientMemory(MlxsupError):
    status = 507
    type = "server_error"
    code = "insufficient_memory"


class WorkerTimeout(MlxsupError):
    status = 504
    type = "server_error"
    code = "timeout"


class RequestAborted(MlxsupError):
    status = 499
    type = "invalid_request_error"
    code = ABORTED


_BY_WORKER_CODE: dict[str, type[MlxsupError]] = {
    CONTEXT_LENGTH_EXCEEDED: ContextLengthExceeded,
    INVALID_REQUEST: InvalidRequest,
    MODEL_EVICTED: ModelEvicted,
    WORKER_CRASHED: WorkerDied,
    ABORTED: RequestAborted,
    OVERLOADED: Overloaded,
}


def from_worker(code: str, message: str) -> MlxsupError:
    """The error for a worker's Failed(code, message)."""
    return _BY_WORKER_CODE.get(code, MlxsupError)(message, code=code)
