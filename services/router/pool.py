"""One tier at run time: its replicas' backends, placement (probes + `placement.rank`), and
opening a request's stream with failover.

NOTE (failover): `open` walks the placement's order. A replica that fails before its first
message with UNAVAILABLE (connection refused, draining, stopped) is marked down and the next one
is tried; RESOURCE_EXHAUSTED (its queue is full) moves on without marking it down. The first
message commits the request to that replica: any later error goes to the caller, since tokens
may already have been relayed. Every attempt is counted in kvmesh_router_requests_total.

NOTE (probes): kv_aware probes every healthy replica at once, each with the probe deadline. A
probe answered UNAVAILABLE marks its replica down (it would fail the request too); a late probe
(DEADLINE_EXCEEDED) only leaves the replica unprobed, ranked after the probed ones: an engine
answers a probe between two steps, so a slow answer means busy, not gone. With one healthy
replica there is nothing to choose and no probe is sent (it would cost up to a step of latency).
A prompt in parts is probed with its leading plain tokens only (`prompts.probe_ids`).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import grpc

from kvmesh.engine.v1 import engine_pb2
from kvmesh.errors import KvmeshError, Unavailable
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.backends import Backend, BackendError, ModelInfo
from kvmesh.services.router.placement import Candidate, Choice, Load, TierState, rank
from kvmesh.services.router.prompts import probe_ids, prompt_tokens
from kvmesh.services.router.topology import Tier


@dataclass(frozen=True)
class PlacementKnobs:
    """The config a TierPool needs (a slice of RouterConfig)."""

    policy: str = "kv_aware"
    probe_timeout_s: float = 0.2
    load_weight: float = 64.0
    generate_timeout_s: float = 600.0


@dataclass
class Opened:
    """A request committed to a replica: its first message, and the rest of its stream."""

    tier: str
    replica: str
    policy: str
    expected_cached_tokens: int
    first: engine_pb2.GenerateResponse
    rest: AsyncIterator[engine_pb2.GenerateResponse]


def new_request_id() -> str:
    return f"rt-{uuid.uuid4().hex}"


class TierPool:
    """The replicas of one tier and the state placement keeps about them."""

    def __init__(self, tier: Tier, backends: Sequence[Backend], knobs: PlacementKnobs,
                 state: TierState, metrics: RouterMetrics) -> None:
        self.tier = tier
        self.metrics = metrics
        self.knobs = knobs
        self.backends: Mapping[str, Backend] = {b.replica.label: b for b in backends}
        self.state = state
        self._info: ModelInfo | None = None

    def _mark_down(self, replica: str, why: str) -> None:
        self.state.mark_down(replica, why)
        self.metrics.replica_down.labels(self.tier.name, replica).inc()

    def _healthy(self) -> list[str]:
        healthy = self.state.healthy()
        if not healthy:
            raise Unavailable(f"no healthy replica in tier {self.tier.name}: "
                              f"{self.state.describe_down()}; retry shortly")
        return healthy

    async def _probe(self, replica: str, ids: Sequence[int], salt: str) -> Load | None:
        backend = self.backends[replica]
        if not backend.can_probe:
            return None
        try:
            return await backend.probe(ids, salt, self.knobs.probe_timeout_s)
        except BackendError as e:
            self.metrics.probe_failures.labels(self.tier.name, replica, e.code.name).inc()
            if e.replica_down:
                self._mark_down(replica, f"probe: {e.message}")
            return None

    async def place(self, request: engine_pb2.GenerateRequest) -> Choice:
        """Rank this tier's healthy replicas for `request` (see the module NOTE)."""
        healthy = self._healthy()
        cursor = self.state.next_cursor()
        ids = probe_ids(request)
        probes: dict[str, Load | None] = {}
        if self.knobs.policy == "kv_aware" and ids is not None and len(healthy) > 1:
            started = time.perf_counter()
            answers = await asyncio.gather(*(self._probe(r, ids, request.cache_salt)
                                             for r in healthy))
            self.metrics.probe_seconds.labels(self.tier.name).observe(time.perf_counter() - started)
            probes = dict(zip(healthy, answers))
            healthy = self._healthy()
        candidates = [Candidate(r, self.state.in_flight[r], probes.get(r)) for r in healthy]
        return rank(self.knobs.policy, candidates, prompt_tokens=prompt_tokens(request),
                    load_weight=self.knobs.load_weight, cursor=cursor)

    @contextlib.asynccontextmanager
    async def open(self, request: engine_pb2.GenerateRequest,
                   prompt_text: str = "") -> AsyncIterator[Opened]:
        """Place `request` and start it on the best replica that takes it (failover, see the
        module NOTE); closing the context closes the stream and cancels the engine call."""
        if not request.request_id:
            request.request_id = new_request_id()
        choice = await self.place(request)
        failures: list[BackendError] = []
        for attempt, ranked in enumerate(choice.ranked):
            replica = ranked.replica
            if attempt and self.state.is_down(replica):
                continue
            policy = choice.policy if attempt == 0 else "failover"
            stream = self.backends[replica].generate(request, prompt_text,
                                                     self.knobs.generate_timeout_s)
            self.state.begin(replica)
            code = grpc.StatusCode.OK
            try:
                try:
                    first = await anext(stream)
                except StopAsyncIteration:
                    raise BackendError(replica, grpc.StatusCode.INTERNAL,
                                       "ended its stream without a message") from None
                except BackendError as e:
                    code = e.code
                    if not e.try_elsewhere:
                        raise
                    if e.replica_down:
                        self._mark_down(replica, e.message)
                    failures.append(e)
                    continue
                self.metrics.placement_cached_tokens.labels(self.tier.name).observe(
                    ranked.cached_tokens)
                yield Opened(self.tier.name, replica, policy, ranked.cached_tokens, first, stream)
                return
            except BackendError as e:
                code = e.code
                raise
            except BaseException as e:  # the consumer's error, or its cancellation
                code = _status_of(e)
                raise
            finally:
                await stream.aclose()
                self.state.end(replica)
                self.metrics.requests.labels(self.tier.name, replica, policy, code.name).inc()
        raise _exhausted(self.tier.name, failures)

    async def model_info(self, timeout: float) -> ModelInfo | None:
        """The tier's model (from the first replica that answers; cached once known)."""
        if self._info is None:
            for replica in self.state.healthy() or list(self.state.replicas):
                try:
                    self._info = await self.backends[replica].model_info(timeout)
                    break
                except BackendError:
                    continue
        return self._info

    async def close(self) -> None:
        for backend in self.backends.values():
            await backend.close()


def _status_of(e: BaseException) -> grpc.StatusCode:
    if isinstance(e, KvmeshError):
        return e.code
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _exhausted(tier: str, failures: list[BackendError]) -> BackendError:
    detail = "; ".join(f"{e.replica}: {e.code.name} {e.message}" for e in failures)
    code = (grpc.StatusCode.UNAVAILABLE
            if all(e.code is grpc.StatusCode.UNAVAILABLE for e in failures)
            else failures[-1].code)
    return BackendError(f"tier {tier}", code, f"every replica failed ({detail})")
