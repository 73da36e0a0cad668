"""Replica backends: one way to talk to each kind of replica behind one small interface.

`EngineBackend` speaks kvmesh.engine.v1 over gRPC; `OpenAIBackend`
(kvmesh.services.router.openai_backend) speaks an OpenAI-compatible `/v1/completions`. Both
raise `BackendError` (a replica's failure, with the gRPC status it maps to), which the router
turns into failover, escalation, or the caller's error.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from kvmesh import errors
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from kvmesh.services.router.placement import Load
from kvmesh.services.router.topology import Replica

_ERRORS: dict[grpc.StatusCode, type[errors.KvmeshError]] = {
    cls.code: cls for cls in (errors.InvalidArgument, errors.NotFound, errors.ResourceExhausted,
                              errors.Unavailable, errors.DeadlineExceeded,
                              errors.FailedPrecondition, errors.Cancelled)}


@dataclass(frozen=True)
class ModelInfo:
    """What a replica serves: the model name and its context length (0 = unknown), and for a
    kvmesh engine its tokenizer fingerprint and model source (empty = unknown)."""

    root: str
    max_model_len: int
    tokenizer_fingerprint: str = ""
    model_source: str = ""


class BackendError(Exception):
    """A replica failed a call; `code` is the gRPC status it means for the caller."""

    def __init__(self, replica: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{replica}: {code.name}: {message}")
        self.replica, self.code, self.message = replica, code, message

    @property
    def replica_down(self) -> bool:
        """The replica is unreachable or draining: skip it for the back-off period."""
        return self.code is grpc.StatusCode.UNAVAILABLE

    @property
    def try_elsewhere(self) -> bool:
        """Another replica may well succeed (down, draining or overloaded)."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def to_error(self, prefix: str = "") -> errors.KvmeshError:
        """The domain error the router's caller gets (same status code)."""
        message = f"{prefix}{self.replica}: {self.message}"
        cls = _ERRORS.get(self.code)
        if cls is not None:
            return cls(message)
        error = errors.KvmeshError(message)
        error.code = self.code
        return error


class Backend(Protocol):
    """One replica. `generate` must cancel its outgoing call when closed early."""

    replica: Replica
    can_probe: bool
    can_resume: bool
    """It continues a request another replica started (GenerateRequest.resume_token_ids)."""

    def generate(self, request: engine_pb2.GenerateRequest, prompt_text: str,
                 timeout: float) -> AsyncIterator[engine_pb2.GenerateResponse]: ...

    async def probe(self, token_ids: Sequence[int], cache_salt: str,
                    timeout: float) -> Load | None: ...

    async def model_info(self, timeout: float) -> ModelInfo: ...

    async def close(self) -> None: ...


class EngineBackend:
    """A kvmesh engine replica over gRPC (a `kvmesh.rpc.client.make_channel` channel)."""

    can_probe = True
    can_resume = True

    def __init__(self, replica: Replica, channel: grpc.aio.Channel) -> None:
        self.replica = replica
        self._channel = channel
        self._stub = engine_pb2_grpc.EngineServiceStub(channel)

    def _error(self, e: grpc.aio.AioRpcError) -> BackendError:
        return BackendError(self.replica.label, e.code(), e.details() or "")

    async def generate(self, request: engine_pb2.GenerateRequest, prompt_text: str,
                       timeout: float) -> AsyncIterator[engine_pb2.GenerateResponse]:
        call = self._stub.Generate(request, timeout=timeout)
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()  # closed early (client cancel, deadline, failover): stop the engine now

    async def probe(self, token_ids: Sequence[int], cache_salt: str,
                    timeout: float) -> Load | None:
        """The replica's cached prefix and load; None when it has no Probe (older engine)."""
        request = engine_pb2.ProbeRequest(token_ids=common_pb2.TokenIds(ids=token_ids),
                                          cache_salt=cache_salt)
        try:
            r = await self._stub.Probe(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise self._error(e) from None
        return Load(r.cached_tokens, r.running, r.waiting, r.pending_prefill_tokens)

    async def model_info(self, timeout: float) -> ModelInfo:
        try:
            info = await self._stub.GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                 timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return ModelInfo(info.model, info.max_model_len, info.tokenizer_fingerprint, info.model_source)

    async def close(self) -> None:
        await self._channel.close()
