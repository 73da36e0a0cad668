"""The router, seen from the gateway: model list (cached), and one generation per choice.

`RouterClient` wraps the RouterService stub. `ModelCatalog` caches ListModels for a few seconds
(names are validated on every request, and /health reads it). `ChoiceStream` runs one upstream
Generate call and turns each RouteResponse into `ChoiceDelta`s; `merge` runs several of them
concurrently (n > 1, batched prompts) and yields their deltas as they come.

NOTE (cancellation). Every upstream call runs in its own task. Closing the merged stream (client
gone, error in a sibling choice, servicer cancelled) cancels those tasks and the calls
themselves (`call.cancel()`), which the router relays to the engine: the engine frees the
request's slot at once rather than generating for nobody.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.services.gateway.errors import ApiError
from kvmesh.services.gateway.spec import (
    ChoiceDelta,
    DocumentUsage,
    EchoedPrompt,
    KvReuse,
    TokenLogprob,
    TopLogprob,
)

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
}


@dataclass(frozen=True)
class ModelEntry:
    """A model clients can name, as the router lists it."""

    id: str
    root: str
    max_model_len: int
    created: int


class RouterClient:
    """Calls to the router over one channel; `timeout_s` bounds each whole generation stream,
    `retry_after_s` is the back-off suggested when the router's answer ends badly."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, retry_after_s: int = 1) -> None:
        self.channel = channel
        self.stub = router_pb2_grpc.RouterServiceStub(channel)
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s

    # Calls wait for the router (wait_for_ready) rather than failing at once while it is
    # unreachable -- restarting, say -- within their deadline.

    async def list_models(self, timeout_s: float = 5.0) -> list[router_pb2.ModelCard]:
        response = await self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout_s,
                                               wait_for_ready=True)
        return list(response.models)

    def generate(self, request: router_pb2.RouteRequest, timeout_s: float | None = None) -> grpc.aio.UnaryStreamCall:
        return self.stub.Generate(request, timeout=self.timeout_s if timeout_s is None else timeout_s,
                                  wait_for_ready=True)


class ModelCatalog:
    """ListModels, cached for `ttl_s`; a name not in the cache triggers one fresh look-up."""

    def __init__(self, router: RouterClient, ttl_s: float) -> None:
        self._router = router
        self._ttl_s = ttl_s
        self._models: dict[str, ModelEntry] = {}
        self._fetched = float("-inf")
        self._first_seen: dict[str, int] = {}
        self._refresh: asyncio.Task[None] | None = None

    async def models(self, *, fresh: bool = False) -> list[ModelEntry]:
        """Every model, from the cache unless it is older than the TTL (or `fresh`)."""
        if fresh or time.monotonic() - self._fetched > self._ttl_s:
            await self._fetch()
        return list(self._models.values())

    def lists(self, model_id: str) -> bool:
        """Whether the cached list holds `model_id` (no look-up)."""
        return model_id in self._models

    async def get(self, model_id: str) -> ModelEntry:
        """The named model; a 404 ApiError (model_not_found) when the router does not list it."""
        await self.models()
        if model_id not in self._models and time.monotonic() - self._fetched > 0.5:
            await self._fetch()
        entry = self._models.get(model_id)
        if entry is None:
            known = ", ".join(sorted(self._models)) or "none"
            raise ApiError(grpc.StatusCode.NOT_FOUND,
                           f"The model `{model_id}` does not exist; available models: {known}",
                           param="model", error_code="model_not_found")
        return entry

    async def _fetch(self) -> None:
        # Concurrent callers share one in-flight ListModels call.
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._do_fetch())
        await asyncio.shield(self._refresh)

    async def _do_fetch(self) -> None:
        cards = await self._router.list_models()
        now = int(time.time())
        self._models = {c.id: ModelEntry(c.id, c.root or c.id, c.max_model_len,
                                         self._first_seen.setdefault(c.id, now)) for c in cards}
        self._fetched = time.monotonic()


def _logprobs(entries) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(e.chosen.token_id, e.chosen.text, e.chosen.logprob,
                     tuple(TopLogprob(t.token_id, t.text, t.logprob) for t in e.top))
        for e in entries)


@dataclass(frozen=True)
class ChoiceJob:
    """One upstream generation: which choice and prompt it serves, and what to send."""

    index: int
    prompt_index: int
    request: router_pb2.RouteRequest
    echo: EchoedPrompt | None = None
    """Completions with echo: the prompt to put on the first delta (prompt logprobs added)."""


@dataclass(frozen=True)
class ChoiceFinal:
    """The end of one choice's stream: what it cost (for the request's usage)."""

    prompt_index: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    documents: DocumentUsage = DocumentUsage()
    """What the engine reported about the prompt's documents (empty for plain prompts)."""
    reuse: KvReuse = KvReuse()
    """How the engine made the prompt's cache hits."""


ROUTER_RETRIES = 2
"""Times one choice calls the router again after UNAVAILABLE (see run_choice)."""


async def run_choice(router: RouterClient, job: ChoiceJob
                     ) -> AsyncIterator[ChoiceDelta | ChoiceFinal]:
    """Stream one choice: its deltas (the last with finish_reason), then its ChoiceFinal.

    A router call that fails UNAVAILABLE (the router died or restarts under its supervisor) is
    made again, waiting for the router, up to ROUTER_RETRIES times within the deadline: from
    the start when nothing reached the client yet, else resuming after the tokens the client
    has (GenerateRequest.resume_token_ids, with the seed the router reported), so the stream
    goes on without a gap or a repeat. The stream is read to its end (the router closes it
    right after the final message), so a finished call ends OK on both sides rather than being
    cancelled.
    """
    started = time.monotonic()
    request, call = job.request, router.generate(job.request)
    streamed: list[int] = []
    seed: int | None = None
    retries = 0
    first = True
    final: ChoiceFinal | None = None
    try:
        while True:
            try:
                async for msg in _stream(call):
                    if msg.HasField("route") and msg.route.HasField("seed"):
                        seed = msg.route.seed
                    out: engine_pb2.GenerateResponse = msg.response
                    if final is not None:
                        continue  # nothing may follow the final message; ignore it if it does
                    streamed += out.delta.token_ids
                    item, final = _choice_item(router, job, out, first)
                    if item is not None:
                        yield item
                        first = False
                break
            except grpc.aio.AioRpcError as err:
                if final is not None:
                    break  # the answer is whole; only the end of the stream was lost
                left = router.timeout_s - (time.monotonic() - started)
                if err.code() is not grpc.StatusCode.UNAVAILABLE or left <= 0 or retries >= ROUTER_RETRIES:
                    raise
                retries += 1
                if not first:
                    request = _resumed(job.request, streamed, seed)
                call = router.generate(request, timeout_s=left)
        if final is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           "the router's stream ended without a final message; retry",
                           retry_after=router.retry_after_s)
        yield final
    finally:
        if not call.done():
            call.cancel()


def _resumed(request: router_pb2.RouteRequest, streamed: list[int], seed: int | None) -> router_pb2.RouteRequest:
    """`request` continued after the tokens its client received (see run_choice)."""
    out = router_pb2.RouteRequest()
    out.CopyFrom(request)
    sampling = out.request.sampling
    out.request.resume_token_ids.ids[:] = [*request.request.resume_token_ids.ids, *streamed]
    sampling.ClearField("prompt_logprobs")
    if seed is not None and not sampling.HasField("seed"):
        sampling.seed = seed
    return out


def _choice_item(router: RouterClient, job: ChoiceJob, out: engine_pb2.GenerateResponse,
                 first: bool) -> tuple[ChoiceDelta | None, ChoiceFinal | None]:
    """What one engine message means for the choice: the delta to send (None when it carries
    nothing), and for the final message the ChoiceFinal."""
    echo = None
    if first and job.echo is not None:
        echo = job.echo
        # The engine sends one entry per prompt token from the second on; without them
        # (a tier that cannot score prompts) the placeholders without logprobs stay.
        prompt_logprobs = out.delta.prompt_logprobs
        if echo.logprobs and len(prompt_logprobs) == len(echo.logprobs) - 1:
            echo = EchoedPrompt(echo.text, echo.token_ids,
                                echo.logprobs[:1] + _logprobs(prompt_logprobs))
    finish = None
    delta = out.delta  # empty on the final message
    final = None
    if out.HasField("final"):
        if out.final.finish_reason not in _FINISH:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           "the engine aborted the request (it may be draining); retry",
                           retry_after=router.retry_after_s)
        finish = _FINISH[out.final.finish_reason]
        u, f = out.final.usage, out.final
        final = ChoiceFinal(job.prompt_index, u.prompt_tokens, u.completion_tokens,
                            u.cached_prompt_tokens,
                            DocumentUsage(tuple(f.document_ids), f.blended_tokens,
                                          f.recomputed_tokens),
                            KvReuse(f.reuse.storage or "exact", f.reuse.kv_service_tokens,
                                    f.reuse.fallback))
    item = None
    if first or delta.text or delta.token_ids or finish:
        item = ChoiceDelta(job.index, delta.text, tuple(delta.token_ids),
                           _logprobs(delta.logprobs), finish, echo, first)
    return item, final


async def _stream(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[router_pb2.RouteResponse]:
    """The call's messages."""
    while (msg := await call.read()) is not grpc.aio.EOF:
        yield msg


_DONE = object()


async def merge(router: RouterClient, jobs: list[ChoiceJob]
                ) -> AsyncIterator[ChoiceDelta | ChoiceFinal]:
    """Run every job concurrently; yield their items as they arrive.

    The first failure cancels the other jobs and is raised. Closing this generator (aclose, or
    cancelling the task iterating it) cancels every job still running — see the module NOTE.
    """
    if len(jobs) == 1:  # the common case needs no tasks
        async with contextlib.aclosing(run_choice(router, jobs[0])) as items:
            async for item in items:
                yield item
        return
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(job: ChoiceJob) -> None:
        try:
            async with contextlib.aclosing(run_choice(router, job)) as items:
                async for item in items:
                    queue.put_nowait(item)
            queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, who raises it
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
