"""gRPC status → HTTP status and OpenAI error type: the one mapping, and exception conversion."""
from __future__ import annotations

import grpc
import pytest

from kvmesh.errors import InvalidArgument, ResourceExhausted, Unauthenticated
from kvmesh.services.gateway.errors import ApiError, error_type, http_status, invalid, to_api_error


@pytest.mark.parametrize("code, status, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
    (grpc.StatusCode.FAILED_PRECONDITION, 500, "server_error"),
    (grpc.StatusCode.UNKNOWN, 500, "server_error"),
])
def test_code_to_status_and_type(code, status, kind):
    assert http_status(code) == status
    assert error_type(status) == kind
    err = ApiError(code, "m")
    assert err.status == status and err.body()["error"]["type"] == kind


def test_body_and_headers():
    err = ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", error_code="overloaded", status=503,
                   retry_after=2)
    assert err.body() == {"error": {"message": "full", "type": "service_unavailable_error",
                                    "param": None, "code": "overloaded"}}
    assert err.headers() == {"Retry-After": "2"}
    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC callers see the code
    bad = invalid("n must be in 1..16", "n")
    assert bad.body()["error"] == {"message": "n must be in 1..16", "type": "invalid_request_error",
                                   "param": "n", "code": "invalid_value"}
    assert bad.headers() == {}


def test_domain_errors_convert():
    assert to_api_error(InvalidArgument("x"), retry_after=1).status == 400
    assert to_api_error(Unauthenticated("who"), retry_after=1).status == 401
    busy = to_api_error(ResourceExhausted("busy"), retry_after=3)
    assert (busy.status, busy.retry_after) == (429, 3)
    same = invalid("x")
    assert to_api_error(same, retry_after=1) is same


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code, status, retry, upstream_code", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, 1, "upstream_overloaded"),
    (grpc.StatusCode.UNAVAILABLE, 503, 1, "upstream_unavailable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None, "timeout"),
    (grpc.StatusCode.INVALID_ARGUMENT, 400, None, None),
])
def test_upstream_rpc_errors_convert(code, status, retry, upstream_code):
    err = to_api_error(_rpc_error(code, "why"), retry_after=1)
    assert (err.status, err.retry_after, err.error_code) == (status, retry, upstream_code)
    assert "why" in err.message


def test_unexpected_exceptions_are_500_without_details(caplog):
    err = to_api_error(KeyError("secret internals"), retry_after=1)
    assert err.status == 500 and "secret internals" not in err.message
    assert "KeyError" in caplog.text
