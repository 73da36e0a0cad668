"""Test helpers for the gateway: a tiny tokenizer, a scriptable fake RouterService, and a harness
that runs the real gateway (uvicorn + gRPC) in front of the fake, in a background event loop.

The fake router behaves like the real stack at the RouterService boundary: it streams
RouteResponses with engine GenerateResponse deltas (text already detokenized, stop strings cut
with FINISH_REASON_STOP_STRING, max_tokens → LENGTH), logprobs and prompt_logprobs when asked,
a final message with usage (cached_prompt_tokens = `cached_tokens`, then `final` merged in), and
it records every call with its metadata. Knobs: `words` (what to generate), `fail` (abort with a status code, after some
tokens), `gate` (hold every generation until released) and `hang` (after the first delta, wait until cancelled). Every
cancellation observed sets the `cancelled` threading.Event, so tests can wait on it with a timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.model.tokenizer import Tokenizer, _byte_alphabet
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.rpc.client import make_channel
from kvmesh.rpc.server import RpcServer, ServerSettings
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.gateway.server import GatewayServer, build_gateway
from kvmesh.telemetry import Telemetry

T = TypeVar("T")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = (" Hello", " from", " the", " fake", " router", ".")
"""What the fake generates, one token per word (the first becomes " Seed<n>" when seeded)."""
MODEL = "tiny"
MAX_MODEL_LEN = 256
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


def tiny_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: token id = byte value; 256 = <|im_start|>, 257 = <|im_end|> (EOS)."""
    vocab = {c: b for b, c in _byte_alphabet().items()}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                                AddedToken("<|im_end|>", special=True, normalized=False)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[257], chat_template=CHATML)


@dataclass
class Recorded:
    """One Generate call the fake received."""

    request: router_pb2.RouteRequest
    metadata: dict[str, str]


@dataclass
class FakeRouterState:
    """What the fake does and what it saw (shared between the test thread and the server loop)."""

    models: list[router_pb2.ModelCard] = field(default_factory=lambda: [
        router_pb2.ModelCard(id=MODEL, root="tiny-root", max_model_len=MAX_MODEL_LEN,
                             kind=router_pb2.MODEL_KIND_TIER, tiers=[MODEL]),
        router_pb2.ModelCard(id="cascade", root="tiny-root", max_model_len=MAX_MODEL_LEN,
                             kind=router_pb2.MODEL_KIND_CASCADE, tiers=[MODEL, "big"])])
    words: tuple[str, ...] = WORDS
    """What every Generate produces, one token per word."""
    cached_tokens: int = 0
    final: engine_pb2.Final | None = None
    """Merged into every final message (e.g. a document prompt's blend counters and usage)."""
    models_fail: grpc.StatusCode | None = None
    """Answer ListModels with this code (e.g. UNAVAILABLE: the router looks down)."""
    fail: tuple[grpc.StatusCode, str, int] | None = None
    """(code, message, after how many tokens) to abort every Generate with."""
    fail_times: int | None = None
    """How many Generate calls `fail` aborts (then it is spent); None = every one."""
    hang: bool = False
    gate: asyncio.Event | None = None
    calls: list[Recorded] = field(default_factory=list)
    received: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    list_calls: int = 0


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    """A RouterService that generates WORDS (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.state = FakeRouterState()

    async def ListModels(self, request, context):
        self.state.list_calls += 1
        if self.state.models_fail is not None:
            await context.abort(self.state.models_fail, "router is down")
        return router_pb2.ListModelsResponse(models=self.state.models)

    def _logprobs(self, token_id: int, text: str, k: int, position: int) -> common_pb2.TokenLogprobs:
        return common_pb2.TokenLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=token_id, logprob=-0.25 * (position + 1),
                                           text=text),
            top=[common_pb2.TokenLogprob(token_id=1000 + j, logprob=-1.0 - j, text=f"alt{j}")
                 for j in range(k)])

    async def Generate(self, request: router_pb2.RouteRequest, context):
        s = self.state
        s.calls.append(Recorded(request, {k: v for k, v in context.invocation_metadata()
                                          if isinstance(v, str)}))
        s.received.set()
        try:
            async for item in self._generate(request, context):
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            s.cancelled.set()
            raise

    async def _generate(self, request: router_pb2.RouteRequest, context):
        s, g = self.state, request.request
        sp = g.sampling
        if s.gate is not None:
            await s.gate.wait()
        fail = s.fail
        if fail is not None and s.fail_times is not None:
            fail = fail if s.fail_times > 0 else None
            s.fail_times -= 1 if fail is not None else 0
        if fail is not None and fail[2] == 0:
            await context.abort(fail[0], fail[1])
        words = list(s.words)
        if sp.HasField("seed"):
            words[0] = f" Seed{sp.seed}"
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 256
        k = sp.logprobs if sp.HasField("logprobs") else None
        ids = list(g.token_ids.ids) or [t for p in g.parts.parts
                                         for t in (*p.tokens.ids, *p.document.ids)]
        first = engine_pb2.GenerateResponse(request_id=g.request_id, delta=engine_pb2.Delta())
        if sp.HasField("prompt_logprobs"):
            first.delta.prompt_logprobs.extend(
                self._logprobs(t, self.tokenizer.decode([t], False), sp.prompt_logprobs, i)
                for i, t in enumerate(ids[1:]))
        yield router_pb2.RouteResponse(response=first, route=router_pb2.RouteInfo(
            tier=MODEL, replica="fake", policy=router_pb2.PLACEMENT_POLICY_KV_AWARE))
        text, generated, finish = "", 0, common_pb2.FINISH_REASON_STOP
        resumed = len(g.resume_token_ids.ids)  # continue after them, as the router and engine do
        for i, word in enumerate(words):
            if i < resumed:
                text, generated = text + word, generated + 1
                continue
            if generated == max_tokens:
                finish = common_pb2.FINISH_REASON_LENGTH
                break
            if fail is not None and generated == fail[2]:
                await context.abort(fail[0], fail[1])
            generated += 1
            cut = min((x for x in ((text + word).find(stop) for stop in sp.stop) if x >= 0),
                      default=-1)
            piece = word if cut < 0 else (text + word)[len(text):cut]
            out = engine_pb2.GenerateResponse(request_id=g.request_id, delta=engine_pb2.Delta(
                token_ids=[2000 + i], text=piece))
            if k is not None:
                out.delta.logprobs.append(self._logprobs(2000 + i, word, k, i))
            yield router_pb2.RouteResponse(response=out)
            text += piece
            if cut >= 0:
                finish = common_pb2.FINISH_REASON_STOP_STRING
                break
            if s.hang:
                await asyncio.Event().wait()  # until cancelled
        final = engine_pb2.Final(
            finish_reason=finish,
            usage=common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=generated,
                                   cached_prompt_tokens=s.cached_tokens))
        if s.final is not None:
            final.MergeFrom(s.final)
        yield router_pb2.RouteResponse(response=engine_pb2.GenerateResponse(
            request_id=g.request_id, final=final))


class GatewayHarness:
    """The real gateway (HTTP + gRPC, port 0) in front of a FakeRouter, on a background loop.

    `run(coro)` executes a coroutine on that loop (to touch the gateway or the fake's asyncio
    objects); `reset()` gives the fake a fresh state between tests.
    """

    def __init__(self, **config: Any) -> None:
        self.config = config
        self.tokenizer = tiny_tokenizer()
        self.fake = FakeRouter(self.tokenizer)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-harness",
                                        daemon=True)
        self.server: GatewayServer | None = None
        self.telemetry = Telemetry.create("kvmesh-gateway")
        """The gateway's (a test may add a span processor to its provider)."""

    @property
    def state(self) -> FakeRouterState:
        return self.fake.state

    @property
    def gateway(self):
        assert self.server is not None
        return self.server.gateway

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run a plain function on the harness loop (asyncio objects are not thread-safe)."""
        async def wrapper() -> T:
            return fn()
        return self.run(wrapper(), timeout)

    def reset(self) -> None:
        models = self.fake.state.models
        self.fake.state = FakeRouterState(models=models)

    async def _start(self) -> None:
        self._router = RpcServer("router", ServerSettings(port=0, grace_s=0.5),
                                 lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(
                                     self.fake, s), [ROUTER_SERVICE],
                                 telemetry=Telemetry.create("kvmesh-fake-router"))
        router_port = await self._router.start()
        self.router_address = f"127.0.0.1:{router_port}"
        config = dict(self.config)
        server = ServerSettings(port=0, grace_s=config.pop("grace_s", 1.0))
        cfg = GatewayConfig(**{"router_address": f"127.0.0.1:{router_port}", "http_port": 0,
                               "server": server, "models_refresh_s": 0.0, **config})
        self._channel = make_channel(cfg.router_address)
        gateway = build_gateway(cfg, self.tokenizer, self._channel,
                                GatewayMetrics(self.telemetry.registry))
        self.server = GatewayServer(cfg, gateway, self.telemetry)
        self.http_port, self.grpc_port = await self.server.start()

    async def _stop(self) -> None:
        assert self.server is not None
        await self.server.stop(0.5)
        await self._channel.close()
        await self._router.drain(0.2)

    def __enter__(self) -> GatewayHarness:
        self._thread.start()
        self.run(self._start())
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


def write_keys(path: Path, tenants: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Create a keys file with one key per tenant via the real CLI code; returns tenant → key."""
    from kvmesh.services.gateway.keys import add_key

    keys = {}
    for name, options in tenants.items():
        _, keys[name] = add_key(path, name, **options)
    return keys

