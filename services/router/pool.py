"""One tier at run time: its replicas' backends, placement (probes + `placement.rank`), and
opening a request's stream with failover.

NOTE (failover): `open` walks the placement's order. A replica that fails before its first
message with UNAVAILABLE (connection refused, draining, stopped) is marked down and the next one
is tried; RESOURCE_EXHAUSTED (its queue is full) moves on without marking it down. The first
message commits the request to that replica. Every attempt is counted in
kvmesh_router_requests_total.

NOTE (migration): once the first message is out, the client holds part of the answer, so a
replica failing later (MIGRATE_ON: killed, unreachable, hung -- detected by the channel's
keepalive pings or the stall timeout -- or broken) is marked down and the request continues on
another replica that can resume: the same request with `resume_token_ids` = every token already
relayed. That engine computes prompt + those tokens (the prompt's prefix from its cache or the KV
service), replays their text and stop-string state without sending them, and streams what comes
next, so the client sees one stream with no gap and nothing twice. Greedy output equals an
uninterrupted run's; seeded sampling too, since a draw depends only on (seed, output position)
and the router pins a seed on sampled requests that have none (Router.generate). The final
usage counts every completion token. At most --migration-limit moves per request; errors that
are the request's own (invalid, deadline, cancelled) are never migrated. Dynamo's frontend
migration (--migration-limit) re-sends prompt + tokens as a new prompt; resuming keeps stop
strings, max_tokens and usage exact.

NOTE (probes): kv_aware probes every healthy replica at once, each with the probe deadline. A
probe answered UNAVAILABLE marks its replica down (it would fail the request too); a late probe
(DEADLINE_EXCEEDED) only leaves the replica unprobed, ranked after the probed ones: an engine
answers a probe between two steps, so a slow answer means busy, not gone. With one healthy
replica there is nothing to choose and no probe is sent (it would cost up to a step of latency).
A prompt in parts is probed with its leading plain tokens only (`prompts.probe_ids`).

NOTE (P/D). A tier whose replicas include both `/prefill` and `/decode` engines (topology)
serves a request in two hops when its prompt is token ids of at least --pd-min-prompt-tokens
and it asks for more than one token. Both replicas are chosen in one decision, before anything
runs: the prefill one among the prefill replicas as any placement ranks them (cached prefix,
queued prefill), the decode one among the decode replicas (their probes see the KV they hold
themselves, e.g. a conversation's earlier turns, and their load). The prefill hop is the
request with max_tokens 1 and kv_handoff: that engine stores the prompt's full chunks in the
KV-cache service while it computes them, streams the first token (relayed at once: the TTFT),
and ends its stream once they are stored. The decode hop is the request resumed after that
token (`continuation`, as a migration): the decode engine fetches the stored chunks instead of
computing them, computes the rest (the prompt's last partial chunk and the first token), and
streams from the second token on. With exact storage (the default) the tokens are the ones a
colocated run gives: the decode engine continues from the same KV and the same token.
Fallbacks, all invisible to the client: a short prompt, one wanted token, a prompt in parts or
text, a pool with no healthy replica, or a prefill hop no prefill replica took: the request
runs colocated, on the decode replicas while one is healthy (prefills of short prompts are
cheap; long ones are what the prefill pool is for), else anywhere. A handoff that stored
nothing or part (KV service down or slow, prefill replica lost after the first token): the
decode engine computes what it could not fetch. A decode hop no decode replica took: any
replica continues it. Each route is counted in kvmesh_router_pd_routes_total.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.errors import KvmeshError, Unavailable
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.backends import Backend, BackendError, ModelInfo
from kvmesh.services.router.placement import Candidate, Choice, Load, TierState, rank
from kvmesh.services.router.prompts import probe_ids, prompt_tokens
from kvmesh.services.router.topology import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementKnobs:
    """The config a TierPool needs (a slice of RouterConfig)."""

    policy: str = "kv_aware"
    probe_timeout_s: float = 0.2
    load_weight: float = 64.0
    generate_timeout_s: float = 600.0
    stall_timeout_s: float = 30.0
    """Longest wait for a stream's next message after its first; 0 = none."""
    migration_limit: int = 3
    """Times one request may move to another replica mid-stream; 0 = never."""
    pd_min_prompt_tokens: int = 256
    """P/D tiers: prompts shorter than this are served colocated on a decode replica."""


MIGRATE_ON = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
"""Mid-stream failures that move a request to another replica: the replica went away (killed,
unreachable, hung past the keepalive or stall deadline, stopped while draining) or broke."""


@dataclass
class _Attempt:
    """One engine call of a request: where, how it was placed, its stream and first message."""

    replica: str
    policy: str
    cached_tokens: int
    stream: AsyncIterator[engine_pb2.GenerateResponse]
    first: engine_pb2.GenerateResponse | None = None
    ended: bool = False


def continuation(request: engine_pb2.GenerateRequest, streamed: Sequence[int]) -> engine_pb2.GenerateRequest:
    """The request that continues `request` after the tokens its client already received: the
    same prompt and sampling (the seed pinned: see Router.generate), resuming after `streamed`;
    prompt logprobs came with the first stream."""
    out = engine_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.resume_token_ids.ids[:] = streamed
    out.sampling.ClearField("prompt_logprobs")
    return out


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
        self.model = tier.name
        """The `model_name` of this pool's series: a tier's model is listed under the tier's name."""
        self.metrics = metrics
        self.knobs = knobs
        self.backends: Mapping[str, Backend] = {b.replica.label: b for b in backends}
        self.state = state
        self._info: ModelInfo | None = None

    def _mark_down(self, replica: str, why: str) -> None:
        self.state.mark_down(replica, why)
        self.metrics.replica_down.labels(self.model, self.tier.name, replica).inc()

    def _healthy(self, only: Collection[str] | None = None) -> list[str]:
        healthy = [r for r in self.state.healthy() if only is None or r in only]
        if not healthy:
            scope = "" if only is None else f" among {', '.join(sorted(only))}"
            raise Unavailable(f"no healthy replica in tier {self.tier.name}{scope}: "
                              f"{self.state.describe_down()}; retry shortly")
        return healthy

    async def _probe(self, replica: str, ids: Sequence[int], salt: str) -> Load | None:
        backend = self.backends[replica]
        if not backend.can_probe:
            return None
        try:
            return await backend.probe(ids, salt, self.knobs.probe_timeout_s)
        except BackendError as e:
            self.metrics.probe_failures.labels(self.model, self.tier.name, replica, e.code.name).inc()
            if e.replica_down:
                self._mark_down(replica, f"probe: {e.message}")
            return None

    async def place(self, request: engine_pb2.GenerateRequest, only: Collection[str] | None = None) -> Choice:
        """Rank this tier's healthy replicas (those in `only`, if given) for `request` (see the
        module NOTE)."""
        healthy = self._healthy(only)
        cursor = self.state.next_cursor()
        ids = probe_ids(request)
        probes: dict[str, Load | None] = {}
        if self.knobs.policy == "kv_aware" and ids is not None and len(healthy) > 1:
            started = time.perf_counter()
            answers = await asyncio.gather(*(self._probe(r, ids, request.cache_salt)
                                             for r in healthy))
            self.metrics.probe_seconds.labels(self.model, self.tier.name).observe(time.perf_counter() - started)
            probes = dict(zip(healthy, answers))
            healthy = self._healthy(only)
        candidates = [Candidate(r, self.state.in_flight[r], probes.get(r)) for r in healthy]
        return rank(self.knobs.policy, candidates, prompt_tokens=prompt_tokens(request),
                    load_weight=self.knobs.load_weight, cursor=cursor)

    async def _start(self, request: engine_pb2.GenerateRequest, prompt_text: str,
                     exclude: Collection[str] = (), migration: bool = False,
                     only: Collection[str] | None = None, choice: Choice | None = None,
                     policy: str = "") -> _Attempt:
        """Place `request` (among `only`, or by the given `choice`) and start it on the best
        replica that takes it (failover, see the module NOTE), skipping `exclude`; returns the
        attempt with its first message. `policy` names the attempt in metrics."""
        choice = choice or await self.place(request, only)
        failures: list[BackendError] = []
        for attempt, ranked in enumerate(choice.ranked):
            replica = ranked.replica
            backend = self.backends[replica]
            if replica in exclude or (attempt and self.state.is_down(replica)) \
                    or (migration and not backend.can_resume):
                continue
            label = policy or ("migration" if migration else choice.policy if attempt == 0 else "failover")
            started = _Attempt(replica, label, ranked.cached_tokens,
                               backend.generate(request, prompt_text, self.knobs.generate_timeout_s))
            self.state.begin(replica)
            try:
                started.first = await anext(started.stream)
            except StopAsyncIteration:
                await self._end(started, grpc.StatusCode.INTERNAL)
                raise BackendError(replica, grpc.StatusCode.INTERNAL,
                                   "ended its stream without a message") from None
            except BackendError as e:
                await self._end(started, e.code)
                if not e.try_elsewhere:
                    raise
                if e.replica_down:
                    self._mark_down(replica, e.message)
                failures.append(e)
                continue
            except BaseException as e:  # the caller's cancellation
                await self._end(started, _status_of(e))
                raise
            self.metrics.placement_cached_tokens.labels(self.model, self.tier.name).observe(ranked.cached_tokens)
            return started
        raise _exhausted(self.tier.name, failures)

    async def _end(self, attempt: _Attempt, code: grpc.StatusCode) -> None:
        """Close an attempt's stream (cancelling its engine call) and count it."""
        await attempt.stream.aclose()
        self.state.end(attempt.replica)
        self.metrics.requests.labels(self.model, self.tier.name, attempt.replica, attempt.policy, code.name).inc()

    @contextlib.asynccontextmanager
    async def open(self, request: engine_pb2.GenerateRequest, prompt_text: str = "",
                   migrate: bool = True) -> AsyncIterator[Opened]:
        """Place `request` and start it on the best replica that takes it (failover, see the
        module NOTE), disaggregated over a prefill and a decode replica where the tier has both
        (see the NOTE on P/D); with `migrate`, a stream its replica breaks after the first
        message goes on on another replica (see the NOTE on migration). Closing the context
        closes the stream and cancels the engine call."""
        if not request.request_id:
            request.request_id = new_request_id()
        attempts: list[_Attempt] = []
        opened = await self._open_pd(request, prompt_text, attempts, migrate)
        if opened is None:
            attempts.append(await self._start(request, prompt_text, only=self._colocated()))
            first = attempts[0]
            opened = Opened(self.tier.name, first.replica, first.policy, first.cached_tokens, first.first,
                            self._rest(attempts, request, prompt_text, migrate))
        code = grpc.StatusCode.OK
        try:
            yield opened
        except BackendError as e:
            code = e.code
            raise
        except BaseException as e:  # the consumer's error, or its cancellation
            code = _status_of(e)
            raise
        finally:
            await opened.rest.aclose()
            if attempts and not attempts[-1].ended:
                await self._end(attempts[-1], code)

    # ---- P/D disaggregation ------------------------------------------------------------------

    def _roles(self, role: str) -> list[str]:
        return [r.label for r in self.tier.replicas if r.role == role]

    def _colocated(self) -> list[str] | None:
        """Where a request runs whole in a P/D tier: its decode (and role-less) replicas while any
        is healthy, else any replica; None (every replica) in a tier without roles."""
        if not self._roles("prefill") and not self._roles("decode"):
            return None
        preferred = [r.label for r in self.tier.replicas if r.role != "prefill"]
        return preferred if any(not self.state.is_down(r) for r in preferred) else None

    async def _pd_split(self, request: engine_pb2.GenerateRequest,
                        prompt_text: str) -> tuple[list[str], list[str]] | None:
        """The healthy prefill and decode replicas when `request` is served disaggregated;
        None (counted with the reason) when it runs colocated."""
        prefill, decode = self._roles("prefill"), self._roles("decode")
        if not prefill or not decode:
            return None
        reason = ""
        n = prompt_tokens(request, prompt_text)
        sampling = request.sampling
        if request.WhichOneof("prompt") != "token_ids":
            reason = "not_token_ids"  # documents (parts) are blended, text has no known length
        elif n < self.knobs.pd_min_prompt_tokens:
            reason = "short_prompt"
        elif sampling.HasField("max_tokens") and sampling.max_tokens <= 1:
            reason = "one_token"
        elif request.HasField("resume_token_ids"):
            reason = "resumed"
        else:
            prefill = [r for r in prefill if not self.state.is_down(r)]
            decode = [r for r in decode if not self.state.is_down(r)]
            if not prefill or not decode:
                reason = "pool_down"
            else:
                info = self._info  # known after the first ListModels or P/D request; checked by
                # the colocated path's engine otherwise (the decode hop must not fail late)
                max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 0
                if info is not None and info.max_model_len and n + max_tokens > info.max_model_len:
                    reason = "too_long"
        if reason:
            self.metrics.pd_routes.labels(self.model, self.tier.name, "colocated", reason).inc()
            return None
        return prefill, decode

    async def _open_pd(self, request: engine_pb2.GenerateRequest, prompt_text: str,
                       attempts: list[_Attempt], migrate: bool) -> Opened | None:
        """Start `request`'s prefill hop (see the NOTE on P/D); None when it runs colocated."""
        split = await self._pd_split(request, prompt_text)
        if split is None:
            return None
        prefill, decode = split
        hop = engine_pb2.GenerateRequest()
        hop.CopyFrom(request)
        hop.sampling.max_tokens = 1
        hop.kv_handoff = True
        # one decision: the prefill replica by cached prefix and queued prefill, the decode
        # replica by load and the prompt's KV it holds itself (a conversation's earlier turns)
        to_prefill, to_decode = await asyncio.gather(self.place(hop, prefill), self.place(request, decode))
        try:
            first = await self._start(hop, prompt_text, choice=to_prefill, policy="pd_prefill")
        except BackendError as e:
            if not e.try_elsewhere:
                raise
            self.metrics.pd_routes.labels(self.model, self.tier.name, "colocated", "prefill_failed").inc()
            return None
        attempts.append(first)
        self.metrics.pd_routes.labels(self.model, self.tier.name, "pd", "").inc()
        span = trace.get_current_span()
        span.set_attributes({"kvmesh.pd.prefill_replica": first.replica,
                             "kvmesh.pd.decode_choice": to_decode.ranked[0].replica})
        return Opened(self.tier.name, f"{first.replica}>{to_decode.ranked[0].replica}", "pd",
                      first.cached_tokens, first.first,
                      self._pd_rest(attempts, request, prompt_text, to_decode, migrate))

    async def _pd_rest(self, attempts: list[_Attempt], request: engine_pb2.GenerateRequest, prompt_text: str,
                       to_decode: Choice, migrate: bool) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """After the prefill hop's first message: the rest of that hop (its final, once the
        prompt's KV is stored), then the decode hop's stream (migrated like any other)."""
        prefill = attempts[0]
        streamed = list(prefill.first.delta.token_ids)
        final = prefill.first if prefill.first.HasField("final") else None
        code = grpc.StatusCode.OK
        try:
            while True:  # to the end of the stream (its call, and its span, end with it)
                try:
                    async with asyncio.timeout(self.knobs.stall_timeout_s or None):
                        message = await anext(prefill.stream)
                except StopAsyncIteration:
                    break
                except (BackendError, TimeoutError) as e:
                    # the first token is out: the decode hop computes whatever was not stored
                    code = e.code if isinstance(e, BackendError) else grpc.StatusCode.DEADLINE_EXCEEDED
                    break
                if message.HasField("final"):
                    final = message
                elif final is None:
                    streamed.extend(message.delta.token_ids)
                    yield message
        finally:
            prefill.ended = True
            await self._end(prefill, code)
        handoff = final.final.handoff if final is not None else None
        span = trace.get_current_span()
        if handoff is not None:
            span.add_event("kvmesh.pd.handoff", {
                "kvmesh.pd.handoff_ok": handoff.ok, "kvmesh.pd.handoff_tokens": handoff.tokens,
                "kvmesh.pd.handoff_bytes": handoff.bytes, "kvmesh.pd.handoff_wait_s": handoff.wait_s})
        if final is not None and final.final.finish_reason != common_pb2.FINISH_REASON_LENGTH:
            yield final  # the answer ended at its first token (end of sequence, a stop string)
            return
        cont = continuation(request, streamed)
        try:
            decode = await self._start(cont, prompt_text, choice=to_decode, migration=True, policy="pd_decode")
        except (BackendError, KvmeshError):
            # no decode replica took it: any replica of the tier continues it (the prefill one
            # holds the prompt's KV in its own cache)
            decode = await self._start(cont, prompt_text, migration=True, policy="pd_fallback")
        attempts.append(decode)
        span.set_attribute("kvmesh.pd.decode_replica", decode.replica)
        yield decode.first
        async with contextlib.aclosing(self._rest(attempts, cont, prompt_text, migrate, start=1)) as rest:
            async for message in rest:
                yield message

    async def _rest(self, attempts: list[_Attempt], request: engine_pb2.GenerateRequest, prompt_text: str,
                    migrate: bool, start: int = 0) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The stream after its first message (attempts[start]'s: `request`'s first attempt),
        migrated when its replica fails mid-stream; migrations are appended to `attempts`."""
        # what the client holds: tokens a caller's own resume carried, then this stream's
        streamed = [*request.resume_token_ids.ids, *attempts[start].first.delta.token_ids]
        stall = self.knobs.stall_timeout_s
        finished = attempts[start].first.HasField("final")
        while True:
            current = attempts[-1]
            try:
                while True:
                    try:
                        # asyncio.timeout, not wait_for: wait_for reads the stream from a task
                        # of its own, and cancelling that task can leave the engine call open
                        async with asyncio.timeout(stall or None):
                            message = await anext(current.stream)
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        raise BackendError(current.replica, grpc.StatusCode.UNAVAILABLE,
                                           f"stalled: no message for {stall:g}s (--stall-timeout-s)") from None
                    if message.HasField("delta"):
                        streamed.extend(message.delta.token_ids)
                    finished = finished or message.HasField("final")
                    yield message
            except BackendError as e:
                if finished:  # the answer is whole: only the end of the stream was lost
                    return
                if not (migrate and e.code in MIGRATE_ON and self.backends[current.replica].can_resume):
                    raise
                current.ended = True
                await self._end(current, e.code)
                self._mark_down(current.replica, e.message)
                if len(attempts) - start > self.knobs.migration_limit:
                    self.metrics.migrations.labels(self.model, self.tier.name, "limit").inc()
                    raise BackendError(e.replica, e.code, f"{e.message} (after {len(attempts) - start - 1} "
                                                          "migrations of this request: --migration-limit)") from None
                try:
                    attempts.append(await self._start(continuation(request, streamed), prompt_text,
                                                      exclude={a.replica for a in attempts[start:]}, migration=True,
                                                      only=self._colocated()))
                except (BackendError, KvmeshError) as failed:
                    self.metrics.migrations.labels(self.model, self.tier.name, "failed").inc()
                    why = failed.message if isinstance(failed, BackendError) else str(failed)
                    raise BackendError(e.replica, e.code, f"{e.message}; migrating the request failed: "
                                                          f"{why}") from None
                self.metrics.migrations.labels(self.model, self.tier.name, "migrated").inc()
                new = attempts[-1]
                log.warning("request %s: %s failed after %d tokens (%s); continued on %s", request.request_id,
                            e.replica, len(streamed), e.message, new.replica)
                trace.get_current_span().add_event("kvmesh.route.migrated", {
                    "kvmesh.route.from_replica": current.replica, "kvmesh.route.to_replica": new.replica,
                    "kvmesh.route.resumed_tokens": len(streamed), "kvmesh.route.reason": e.message})
                if new.first.HasField("delta"):
                    streamed.extend(new.first.delta.token_ids)
                finished = new.first.HasField("final")
                yield new.first

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
    if not failures:
        return BackendError(f"tier {tier}", grpc.StatusCode.UNAVAILABLE,
                            "no other replica can take the request")
    detail = "; ".join(f"{e.replica}: {e.code.name} {e.message}" for e in failures)
    code = (grpc.StatusCode.UNAVAILABLE
            if all(e.code is grpc.StatusCode.UNAVAILABLE for e in failures)
            else failures[-1].code)
    return BackendError(f"tier {tier}", code, f"every replica failed ({detail})")
