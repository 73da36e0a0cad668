"""Domain exceptions, each bound to exactly one gRPC status code.

Servicers and domain code raise these; the server interceptor (`kvmesh.rpc.interceptors`) is
the one place that turns them into status codes, and the gateway the one place that turns codes
into HTTP. The message is for the caller and says what to fix or what to do next, e.g.
``InvalidArgument("max_tokens must be in 1..4096, got 0; lower the prompt or max_tokens")``.
"""

from __future__ import annotations

import grpc


class KvmeshError(Exception):
    """Base of all kvmesh domain errors; `code` is the gRPC status the caller receives."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvmeshError):
    """The request is malformed or out of range; retrying it unchanged will fail again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvmeshError):
    """The named entity (request id, chunk, document, model) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(KvmeshError):
    """Overload or quota: the caller should back off or go elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvmeshError):
    """The service is draining, starting or down; retrying elsewhere or later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KvmeshError):
    """The work could not finish before the call's deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class FailedPrecondition(KvmeshError):
    """The system is not in a state that allows the operation (e.g. namespace mismatch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Cancelled(KvmeshError):
    """The operation was cancelled (client cancel, Abort call)."""

    code = grpc.StatusCode.CANCELLED


class Unauthenticated(KvmeshError):
    """The call carries no valid credentials (missing or unknown API key)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KvmeshError):
    """The caller is known but may not do this (e.g. a model outside its tenant's allowance)."""

    code = grpc.StatusCode.PERMISSION_DENIED
