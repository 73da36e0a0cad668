"""Test helpers for the router: scriptable fake engines (real gRPC servers on port 0, in this
process), a fake OpenAI-compatible HTTP endpoint, and a router served in-process.

    async with fake_engines(Script(cached_tokens=64), Script()) as (a, b):
        async with serving_router(router_config(tiers=f"t={a.address},{b.address}")) as r:
            msgs = await r.collect(route_request([1, 2, 3]))
    assert a.generate_calls and not b.generate_calls
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.rpc.server import RpcServer, ServerSettings
from rpc_utils import served
from kvmesh.services.router.build import build_router
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.servicer import RouterServicer
from kvmesh.telemetry import Telemetry

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


@dataclass
class Script:
    """What a fake engine answers. Every field can be changed between requests."""

    tokens: Sequence[int] = (101, 102, 103)
    logprobs: Sequence[float] | None = None      # chosen logprob per token; default -0.1 each
    top: Sequence[Sequence[float]] | None = None  # alternatives per token; default chosen - i
    cached_tokens: int = 0
    running: int = 0
    waiting: int = 0
    pending_prefill_tokens: int = 0
    probe_error: grpc.StatusCode | None = None
    probe_hangs: bool = False                     # Probe never answers (the caller's deadline ends it)
    generate_error: tuple[grpc.StatusCode, str] | None = None  # before the first message
    fail_after: int | None = None                 # UNAVAILABLE after this many tokens (of the whole output)
    fail_after_final: bool = False                # UNAVAILABLE right after the final message
    hold_after: int | None = None                 # wait for `release` after this many tokens
    model: str = "fake-model"
    max_model_len: int = 2048
    final: engine_pb2.Final | None = None         # merged into the final message


class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    """An EngineService that follows its Script and records every call."""

    def __init__(self, name: str, script: Script) -> None:
        self.name, self.script = name, script
        self.address = ""
        self.server: RpcServer | None = None
        self.generate_calls: list[engine_pb2.GenerateRequest] = []
        self.time_remaining: list[float | None] = []  # each Generate call's deadline, in s
        self.probe_calls: list[engine_pb2.ProbeRequest] = []
        self.info_calls = 0
        self.cancelled: list[str] = []          # request ids whose stream was cancelled
        self.cancelled_event = asyncio.Event()
        self.holding = asyncio.Event()          # a stream reached hold_after
        self.release = asyncio.Event()

    def text(self, token: int) -> str:
        return f" {self.name}{token}"

    def _logprobs(self, i: int, token: int, k: int) -> common_pb2.TokenLogprobs:
        s = self.script
        chosen = s.logprobs[i] if s.logprobs is not None else -0.1
        top = list(s.top[i]) if s.top is not None else [chosen - j for j in range(k)]
        return common_pb2.TokenLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=token, logprob=chosen, text=self.text(token)),
            top=[common_pb2.TokenLogprob(token_id=token + j, logprob=v, text=self.text(token + j))
                 for j, v in enumerate(top[:k])])

    async def Generate(self, request, context):
        self.generate_calls.append(request)
        self.time_remaining.append(context.time_remaining())
        s, rid = self.script, request.request_id
        if s.generate_error is not None:
            await context.abort(*s.generate_error)
        want = request.sampling.logprobs if request.sampling.HasField("logprobs") else None
        resumed = len(request.resume_token_ids.ids)  # a migrated request: go on after those, as an engine does
        # a P/D prefill hop stops at its max_tokens (1) as an engine does; other calls play the script
        limit = request.sampling.max_tokens if request.kv_handoff else len(s.tokens)
        done = False
        try:
            for i, token in enumerate(s.tokens):
                if i < resumed:
                    continue
                if i >= limit:
                    break
                if s.fail_after is not None and i == s.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} crashed")
                if s.hold_after is not None and i == s.hold_after:
                    self.holding.set()
                    await self.release.wait()
                msg = engine_pb2.GenerateResponse(request_id=rid, delta=engine_pb2.Delta(
                    token_ids=[token], text=self.text(token)))
                if want is not None:
                    msg.delta.logprobs.append(self._logprobs(i, token, want))
                yield msg
            done = True
            prompt = len(request.token_ids.ids) or len(request.text.split())
            cut = limit < len(s.tokens)
            final = engine_pb2.Final(
                finish_reason=common_pb2.FINISH_REASON_LENGTH if cut else common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(prompt_tokens=prompt, completion_tokens=min(limit, len(s.tokens)),
                                       cached_prompt_tokens=s.cached_tokens))
            if request.kv_handoff:
                final.handoff.CopyFrom(engine_pb2.KvHandoff(ok=True, tokens=prompt // 256 * 256, bytes=1000))
            if s.final is not None:
                final.MergeFrom(s.final)
            yield engine_pb2.GenerateResponse(request_id=rid, final=final)
            if s.fail_after_final:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} crashed after the end")
        finally:
            if not done:
                self.cancelled.append(rid)
                self.cancelled_event.set()

    async def Probe(self, request, context):
        self.probe_calls.append(request)
        s = self.script
        if s.probe_hangs:  # late by construction, not by a race between a sleep and a deadline
            await asyncio.Event().wait()
        if s.probe_error is not None:
            await context.abort(s.probe_error, f"{self.name} probe failed")
        return engine_pb2.ProbeResponse(
            cached_tokens=min(s.cached_tokens, len(request.token_ids.ids)), running=s.running,
            waiting=s.waiting, pending_prefill_tokens=s.pending_prefill_tokens,
            free_blocks=100, num_blocks=128)

    async def GetModelInfo(self, request, context):
        self.info_calls += 1
        return engine_pb2.GetModelInfoResponse(model=self.script.model,
                                               max_model_len=self.script.max_model_len)

    async def Abort(self, request, context):
        return engine_pb2.AbortResponse(aborted=False)


@contextlib.asynccontextmanager
async def fake_engines(*scripts: Script) -> AsyncIterator[list[FakeEngine]]:
    """One fake engine server per script (named e0, e1, ...), each on its own port."""
    engines: list[FakeEngine] = []
    try:
        for i, script in enumerate(scripts):
            engine = FakeEngine(f"e{i}", script)
            engine.server = RpcServer(
                f"fake-engine-{i}", ServerSettings(port=0, grace_s=0.5),
                lambda s, e=engine: engine_pb2_grpc.add_EngineServiceServicer_to_server(e, s),
                [ENGINE_SERVICE], telemetry=Telemetry.create(f"kvmesh-fake-engine-{i}"))
            engine.address = f"127.0.0.1:{await engine.server.start()}"
            engines.append(engine)
        yield engines
    finally:
        for engine in engines:
            engine.release.set()
            if engine.server is not None and engine.server._drain_task is None:
                await engine.server.drain(0.2)


_RESERVED: list[socket.socket] = []


def dead_address() -> str:
    """A loopback host:port with nothing listening (connections are refused). The port stays
    bound (never listening) for the rest of the session, so no server started later gets it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    return f"127.0.0.1:{s.getsockname()[1]}"


def router_config(**overrides) -> RouterConfig:
    """A RouterConfig for tests (port 0, short timeouts), validated like a loaded one."""
    base = dict(server=ServerSettings(port=0), probe_timeout_s=1.0, down_backoff_s=30.0, generate_timeout_s=10.0,
                info_timeout_s=2.0)
    cfg = RouterConfig(**{**base, **overrides})
    cfg.validate()
    return cfg


def route_request(ids: Sequence[int] = (1, 2, 3), model: str = "", **sampling
                  ) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(
        model=model, tenant="t1",
        request=engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids),
                                           sampling=engine_pb2.SamplingParams(**sampling)))


@dataclass
class RouterHarness:
    address: str
    stub: router_pb2_grpc.RouterServiceStub
    servicer: RouterServicer
    server: RpcServer

    async def collect(self, request: router_pb2.RouteRequest, timeout: float = 10
                      ) -> list[router_pb2.RouteResponse]:
        return [m async for m in self.stub.Generate(request, timeout=timeout)]


@contextlib.asynccontextmanager
async def serving_router(cfg: RouterConfig, telemetry: Telemetry | None = None
                         ) -> AsyncIterator[RouterHarness]:
    """The router for `cfg` on port 0 behind the shared interceptor, with a client stub; its
    metrics and spans go to `telemetry` (default: a fresh one, `server.telemetry`)."""
    telemetry = telemetry or Telemetry.create("kvmesh-router")
    router = build_router(cfg, RouterMetrics(telemetry.registry))
    servicer = RouterServicer(router)
    try:
        async with served("router", lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, s),
                          ROUTER_SERVICE, grace_s=0.5, telemetry=telemetry) as srv:
            yield RouterHarness(srv.address, router_pb2_grpc.RouterServiceStub(srv.channel), servicer, srv.server)
    finally:
        await router.close()


def text_of(messages: Sequence[router_pb2.RouteResponse]) -> str:
    return "".join(m.response.delta.text for m in messages)


# --- a fake OpenAI-compatible endpoint ------------------------------------------------------

@dataclass
class FakeOpenAI:
    """A tiny /v1/completions + /v1/models server; `bodies` records each completion request."""

    model: str = "fake-oai"
    pieces: Sequence[str] = ("Hello", ",", " world")
    logprob: float = -0.05
    status: int = 200
    send_usage: bool = True
    max_model_len: int = 4096
    bodies: list[dict] = field(default_factory=list)
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.model, "object": "model",
                                                "root": f"{self.model}-root",
                                                "max_model_len": self.max_model_len}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            if self.status != 200:
                return JSONResponse({"error": {"message": "nope"}}, status_code=self.status)
            return StreamingResponse(self._sse(body), media_type="text/event-stream")

        return app

    async def _sse(self, body: dict) -> AsyncIterator[bytes]:
        k = body.get("logprobs")
        for i, piece in enumerate(self.pieces):
            choice: dict = {"index": 0, "text": piece, "finish_reason": None}
            if k is not None:
                alternatives = list({piece: self.logprob, "alt": self.logprob - 2}.items())[:k]
                choice["logprobs"] = {"tokens": [piece], "token_logprobs": [self.logprob],
                                      "top_logprobs": [dict(alternatives)] if k else None}
            if i == len(self.pieces) - 1:
                choice["finish_reason"] = "length"
            yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
        if self.send_usage:
            usage = {"prompt_tokens": 7, "completion_tokens": len(self.pieces),
                     "total_tokens": 7 + len(self.pieces)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def serving_openai(fake: FakeOpenAI) -> AsyncIterator[FakeOpenAI]:
    """Serves `fake` with uvicorn on a pre-bound loopback socket (no readiness wait needed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        yield fake
    finally:
        server.should_exit = True
        await task
        sock.close()
