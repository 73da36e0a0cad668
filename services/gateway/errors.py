"""The one place where gRPC status codes become HTTP statuses and OpenAI error bodies.

Domain code raises `ApiError` (or any `kvmesh.errors.KvmeshError`); upstream calls fail with
`grpc.aio.AioRpcError`. `to_api_error` turns any of them into an `ApiError`, which the HTTP app
renders as ``{"error": {"message", "type", "param", "code"}}`` with `http_status`, and the gRPC
servicer (through the shared interceptor) as its status code. The same code means the same thing
on both front ends; the single exception is the gateway's own overload, which OpenAI clients
expect as 503 + Retry-After (to back off and retry) while gRPC callers get RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import logging
from typing import Any

import grpc

from kvmesh.errors import KvmeshError

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # OpenAI's type for an unknown model, with code model_not_found
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status an OpenAI client expects for a gRPC status code (500 for the rest)."""
    return _HTTP_STATUS.get(code, 500)


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return _ERROR_TYPE.get(status, "server_error")


class ApiError(KvmeshError):
    """A request failure with everything both front ends need to report it.

    `code` is the gRPC status; `param` names the offending request field (OpenAI's `param`);
    `error_code` is OpenAI's machine-readable `code` (e.g. "model_not_found",
    "context_length_exceeded"); `status` overrides the HTTP status derived from `code`;
    `retry_after` (seconds) becomes a Retry-After header / trailing metadata.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, param: str | None = None,
                 error_code: str | None = None, status: int | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(_encodable(message))
        self.code = code
        self.param = _encodable(param)
        self.error_code = error_code
        self.status = http_status(code) if status is None else status
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.error_code}}

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers (Retry-After when set)."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


def _encodable(text: str | None) -> str | None:
    """`text` with each lone UTF-16 surrogate written as its escape (\\ud800): a message may quote
    the client's input (a JSON object key can hold one), and both front ends send it as UTF-8."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None, error_code: str | None = None) -> ApiError:
    """A 400 / INVALID_ARGUMENT naming the offending parameter."""
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param,
                    error_code=error_code or ("invalid_value" if param else None))


def to_api_error(exc: BaseException, *, retry_after: int) -> ApiError:
    """Any failure of a request as an ApiError (unexpected ones are logged, with a generic message).

    An upstream RESOURCE_EXHAUSTED or UNAVAILABLE carries `retry_after`: the router or an engine
    is overloaded or restarting, so backing off is the right move.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, KvmeshError):
        return ApiError(exc.code, exc.message, retry_after=_backoff(exc.code, retry_after))
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        details = exc.details() or code.name
        message = f"upstream {code.name.lower()}: {details}"
        if code is grpc.StatusCode.UNAVAILABLE:
            message = f"the router is unavailable ({details}); retry shortly"
        return ApiError(code, message, error_code=_UPSTREAM_CODES.get(code),
                        retry_after=_backoff(code, retry_after))
    log.error("unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
    return ApiError(grpc.StatusCode.INTERNAL,
                    f"internal error in the gateway ({type(exc).__name__}); see its log")


_UPSTREAM_CODES = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: "upstream_overloaded",
    grpc.StatusCode.UNAVAILABLE: "upstream_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
}


def _backoff(code: grpc.StatusCode, retry_after: int) -> int | None:
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        return retry_after
    return None
