"""The router's request path: resolve the requested model to a tier or a cascade route, run it
on placed replicas, and relay the kept answer with where and why it ran (RouteInfo, metrics,
span attributes). Cascade decisions themselves are in `cascade`, placement in `placement`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import trace

from kvmesh.engine.v1 import engine_pb2
from kvmesh.errors import InvalidArgument, KvmeshError, NotFound
from kvmesh.router.v1 import router_pb2
from kvmesh.services.router import cascade
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.backends import BackendError
from kvmesh.services.router.pool import Opened, TierPool, new_request_id
from kvmesh.services.router.prompts import prompt_tokens
from kvmesh.services.router.topology import Cascade, Topology

log = logging.getLogger(__name__)

_POLICIES = {"kv_aware": router_pb2.PLACEMENT_POLICY_KV_AWARE,
             "round_robin": router_pb2.PLACEMENT_POLICY_ROUND_ROBIN,
             "least_loaded": router_pb2.PLACEMENT_POLICY_LEAST_LOADED,
             "failover": router_pb2.PLACEMENT_POLICY_FAILOVER,
             "pd": router_pb2.PLACEMENT_POLICY_PD}
_SIGNALS = {"": router_pb2.CONFIDENCE_SIGNAL_UNSPECIFIED,
            "mean_logprob": router_pb2.CONFIDENCE_SIGNAL_MEAN_LOGPROB,
            "min_logprob": router_pb2.CONFIDENCE_SIGNAL_MIN_LOGPROB,
            "neg_entropy": router_pb2.CONFIDENCE_SIGNAL_NEG_ENTROPY}
_REASONS = {"confident": router_pb2.CASCADE_REASON_CONFIDENT,
            "low_confidence": router_pb2.CASCADE_REASON_LOW_CONFIDENCE,
            "difficulty": router_pb2.CASCADE_REASON_DIFFICULTY,
            "last_tier": router_pb2.CASCADE_REASON_LAST_TIER,
            "tier_failed": router_pb2.CASCADE_REASON_TIER_FAILED}


@dataclass(frozen=True)
class CascadeKnobs:
    """The config cascade routes need (a slice of RouterConfig)."""

    signal: str = "mean_logprob"
    threshold: float = -0.5
    difficulty_prompt_tokens: int = 0


def _pin_seed(sampling: engine_pb2.SamplingParams) -> None:
    """Gives a sampled request without a seed a random one, so that a replica continuing it
    after a failure (pool's NOTE on migration) draws what the failed one would have. Greedy
    requests are left alone: a seed would make the engine sample (temperature 1)."""
    if sampling.HasField("temperature"):
        sampled = sampling.temperature > 0
    else:
        sampled = sampling.HasField("top_k") or sampling.HasField("top_p")
    if sampled and not sampling.HasField("seed"):
        sampling.seed = secrets.randbits(63)


def token_scores(messages: Sequence[engine_pb2.GenerateResponse]) -> list[cascade.TokenScore]:
    return [cascade.TokenScore(lp.chosen.logprob, tuple(t.logprob for t in lp.top))
            for m in messages for lp in m.delta.logprobs]


def strip_logprobs(messages: Sequence[engine_pb2.GenerateResponse],
                   client_logprobs: int | None) -> None:
    """Drop the log-probabilities the router forced on and the client did not ask for."""
    for m in messages:
        if not m.HasField("delta"):
            continue
        if client_logprobs is None:
            del m.delta.logprobs[:]
            continue
        for lp in m.delta.logprobs:
            del lp.top[client_logprobs:]


def _completion_tokens(messages: Sequence[engine_pb2.GenerateResponse]) -> int:
    for m in reversed(messages):
        if m.HasField("final"):
            return m.final.usage.completion_tokens
    return sum(max(len(m.delta.token_ids), len(m.delta.logprobs)) for m in messages)


def _info(opened: Opened, steps: Sequence[cascade.Step] = ()) -> router_pb2.RouteInfo:
    return router_pb2.RouteInfo(
        tier=opened.tier, replica=opened.replica, policy=_POLICIES[opened.policy],
        expected_cached_tokens=opened.expected_cached_tokens,
        cascade=[router_pb2.CascadeStep(
            tier=s.tier, signal=_SIGNALS[s.signal], confidence=s.confidence, threshold=s.threshold,
            accepted=s.accepted, reason=_REASONS[s.reason], completion_tokens=s.completion_tokens)
            for s in steps])


class Router:
    """Runs requests on the tiers and cascade routes of one topology."""

    def __init__(self, topology: Topology, pools: Mapping[str, TierPool], metrics: RouterMetrics,
                 knobs: CascadeKnobs = CascadeKnobs(), info_timeout_s: float = 2.0) -> None:
        self.topology = topology
        self.metrics = metrics
        self.pools = pools
        self.knobs = knobs
        self.info_timeout_s = info_timeout_s
        self._cascades = {c.name: c for c in topology.cascades}

    async def generate(self, req: router_pb2.RouteRequest
                       ) -> AsyncIterator[router_pb2.RouteResponse]:
        """Place `req` and stream the kept answer; RouteInfo rides on the first message."""
        name = req.model or self.topology.default_model
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(req.request)
        if request.WhichOneof("prompt") is None and not req.prompt_text:
            raise InvalidArgument("RouteRequest.request needs a prompt: set token_ids, parts "
                                  "or text")
        if not request.request_id:
            request.request_id = new_request_id()
        _pin_seed(request.sampling)
        trace.get_current_span().set_attributes(
            {"kvmesh.route.model": name, "kvmesh.route.tenant": req.tenant})
        if name in self.pools:
            stream = self._tier(name, request, req.prompt_text)
        elif name in self._cascades:
            knobs = self.knobs
            if req.HasField("cascade_threshold"):
                if not req.cascade_threshold <= 0:
                    raise InvalidArgument(f"cascade_threshold {req.cascade_threshold} can never be met: "
                                          "confidence signals are log-probabilities (<= 0); use a value <= 0")
                knobs = dataclasses.replace(knobs, threshold=req.cascade_threshold)
            stream = self._cascade(self._cascades[name], request, req.prompt_text, knobs)
        else:
            raise NotFound(f"model {req.model!r} is not served here; use one of "
                           f"{', '.join(self.topology.model_names)} (or leave it empty for "
                           f"{self.topology.default_model})")
        seed = request.sampling.seed if request.sampling.HasField("seed") else None
        try:
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    if seed is not None and response.HasField("route"):
                        response.route.seed = seed
                    yield response
        except BackendError as e:
            raise e.to_error() from None

    async def _relay(self, opened: Opened, held: Sequence[engine_pb2.GenerateResponse] = (),
                     steps: Sequence[cascade.Step] = ()
                     ) -> AsyncIterator[router_pb2.RouteResponse]:
        """Stream `held` messages (a kept cascade answer), or else opened's live stream."""
        span = trace.get_current_span()
        span.set_attributes({"kvmesh.route.tier": opened.tier,
                             "kvmesh.route.replica": opened.replica,
                             "kvmesh.route.policy": opened.policy,
                             "kvmesh.route.expected_cached_tokens": opened.expected_cached_tokens})
        info = _info(opened, steps)
        if held:
            yield router_pb2.RouteResponse(response=held[0], route=info)
            for message in held[1:]:
                yield router_pb2.RouteResponse(response=message)
            return
        live = [opened.first]
        yield router_pb2.RouteResponse(response=opened.first, route=info)
        async for message in opened.rest:
            if message.HasField("final"):
                live.append(message)
            yield router_pb2.RouteResponse(response=message)
        self._account(opened.tier, _completion_tokens(live))

    def _account(self, tier: str, tokens: int) -> None:
        pool = self.pools[tier]
        self.metrics.generated_tokens.labels(pool.model, tier).inc(tokens)
        self.metrics.cost.labels(pool.model, tier).inc(tokens * pool.tier.cost_per_token)

    async def _tier(self, tier: str, request: engine_pb2.GenerateRequest,
                    prompt_text: str) -> AsyncIterator[router_pb2.RouteResponse]:
        async with self.pools[tier].open(request, prompt_text) as opened:
            async with contextlib.aclosing(self._relay(opened)) as responses:
                async for response in responses:
                    yield response

    async def _cascade(self, route: Cascade, request: engine_pb2.GenerateRequest,
                       prompt_text: str, knobs: CascadeKnobs) -> AsyncIterator[router_pb2.RouteResponse]:
        """Run the route's tiers cheapest first (see the NOTE in `cascade`)."""
        plan = cascade.plan(route.tiers, prompt_tokens(request, prompt_text),
                            knobs.difficulty_prompt_tokens, knobs.threshold)
        steps = list(plan.skipped)
        sampling = request.sampling
        client_logprobs = sampling.logprobs if sampling.HasField("logprobs") else None
        for tier in plan.run[:-1]:
            held_request = engine_pb2.GenerateRequest()
            held_request.CopyFrom(request)
            held_request.sampling.logprobs = cascade.logprobs_needed(knobs.signal,
                                                                     client_logprobs)
            messages: list[engine_pb2.GenerateResponse] = []
            try:
                async with self.pools[tier].open(held_request, prompt_text) as opened:
                    messages.append(opened.first)
                    async for message in opened.rest:
                        messages.append(message)
            except (BackendError, KvmeshError) as e:
                log.info("cascade %s: tier %s failed, escalating: %s", route.name, tier, e)
                steps.append(cascade.failed(tier, knobs.threshold, len(token_scores(messages))))
                continue
            finally:
                self._account(tier, _completion_tokens(messages))
            steps.append(cascade.judge(tier, knobs.signal, knobs.threshold,
                                       token_scores(messages)))
            if steps[-1].accepted:
                self._record(route, steps)
                strip_logprobs(messages, client_logprobs)
                async with contextlib.aclosing(self._relay(opened, messages, steps)) as out:
                    async for response in out:
                        yield response
                return
        last, committed = plan.run[-1], False
        try:
            async with self.pools[last].open(request, prompt_text) as opened:
                steps.append(cascade.last_tier(last, knobs.threshold))
                self._record(route, steps)
                committed = True
                async with contextlib.aclosing(self._relay(opened, (), steps)) as out:
                    async for response in out:
                        yield response
        except (BackendError, KvmeshError):
            if not committed:  # the last tier could not start: the caller gets its error
                self._record(route, [*steps, cascade.failed(last, knobs.threshold)])
            raise

    def _record(self, route: Cascade, steps: Sequence[cascade.Step]) -> None:
        """Count the route's decisions and put them on the current span."""
        span = trace.get_current_span()
        for s in steps:
            self.metrics.cascade_decisions.labels(route.name, route.name, s.tier, s.reason).inc()  # model: the route
            span.add_event("kvmesh.cascade.step", {
                "kvmesh.cascade.tier": s.tier, "kvmesh.cascade.signal": s.signal,
                "kvmesh.cascade.confidence": s.confidence,
                "kvmesh.cascade.threshold": s.threshold,
                "kvmesh.cascade.accepted": s.accepted, "kvmesh.cascade.reason": s.reason,
                "kvmesh.cascade.completion_tokens": s.completion_tokens})
        span.set_attributes({
            "kvmesh.cascade.route": route.name,
            "kvmesh.cascade.escalated": len(steps) > 1,
            "kvmesh.cascade.reason": steps[-1].reason,
            "kvmesh.cascade.tiers": [s.tier for s in steps],
            "kvmesh.cascade.reasons": [s.reason for s in steps]})

    async def list_models(self) -> list[router_pb2.ModelCard]:
        """One card per tier (its engines' model, cached once known), one per cascade."""
        names = [t.name for t in self.topology.tiers]
        infos = dict(zip(names, await asyncio.gather(
            *(self.pools[n].model_info(self.info_timeout_s) for n in names))))
        cards = [router_pb2.ModelCard(
            id=n, root=infos[n].root if infos[n] else "",
            max_model_len=infos[n].max_model_len if infos[n] else 0,
            kind=router_pb2.MODEL_KIND_TIER, tiers=[n],
            tokenizer_fingerprint=infos[n].tokenizer_fingerprint if infos[n] else "",
            model_source=infos[n].model_source if infos[n] else "")
            for n in names]
        for c in self.topology.cascades:
            known = [infos[t] for t in c.tiers]
            first = known[0]
            max_len = (min(i.max_model_len for i in known)
                       if all(i and i.max_model_len for i in known) else 0)
            cards.append(router_pb2.ModelCard(id=c.name, root=first.root if first else "",
                                              max_model_len=max_len, kind=router_pb2.MODEL_KIND_CASCADE,
                                              tiers=list(c.tiers)))
        return cards

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()
