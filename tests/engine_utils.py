"""Test helpers for the engine: an EngineCore with the deployment's settings, driven synchronously
(no threads, exact) or served on a real port with its step loop moved by counted steps
(`StepGate`), and a scriptable fake draft service. Nothing here waits on the wall clock."""
from __future__ import annotations

import threading
import time

from kvmesh.draft.v1 import draft_pb2, draft_pb2_grpc
from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core import EngineCore, EngineRequest
from kvmesh.services.engine.sampling import SamplingParams


def make_core(loaded, *, draft_clock=None, **overrides) -> EngineCore:
    """An EngineCore on `loaded` with the deployment's settings (EngineConfig's defaults: adaptive
    speculation, up to 7 drafts within 8 decode rows a step, a 0.1 s Propose deadline, ...) on a
    small KV pool; a test about another setting names it in `overrides`. `draft_clock` (e.g. a
    FakeClock) times the draft client's back-off, so a retry period passes when the test says."""
    cfg = EngineConfig(**{"num_blocks": 512, **overrides})  # the deployment's pool is 1 GiB
    if draft_clock is None:
        return build_core(cfg, loaded)
    return build_core(cfg, loaded, clock=draft_clock)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_all(core: EngineCore, prompts: dict[str, list[int]], params: dict[str, SamplingParams] | SamplingParams,
            max_steps: int = 100_000, resume: dict[str, list[int]] | None = None) -> dict[str, dict]:
    """Adds every request at once (those in `resume` continuing after those output tokens, as
    in request migration), steps until all finish; returns per-request tokens/text/final and
    "texts", the text of each output in order."""
    results: dict[str, dict] = {}
    for rid, ids in prompts.items():
        p = params[rid] if isinstance(params, dict) else params
        core.validate(ids, p)
        results[rid] = {"tokens": [], "text": "", "final": None, "logprobs": [], "prompt_logprobs": [],
                        "texts": []}
        done = core.add_request(EngineRequest(rid, list(ids), p, time.monotonic(),
                                              resume_token_ids=tuple((resume or {}).get(rid, ()))))
        if done is not None:
            results[rid]["final"] = done
    for _ in range(max_steps):
        if not core.has_work:
            break
        for out in core.step():
            r = results[out.request_id]
            r["tokens"] += out.token_ids
            r["text"] += out.text
            r["texts"].append(out.text)
            r["logprobs"] += out.logprobs
            r["prompt_logprobs"] += out.prompt_logprobs
            if out.finished:
                r["final"] = out
    assert all(r["final"] is not None for r in results.values()), "engine stopped with unfinished requests"
    return results


# ---- a tiny random-weight model with a byte-level tokenizer (no downloads, loads in ms) ---------

TINY_EOS = 256
"""The tiny model's end-of-sequence id (ids 0..255 are the 256 bytes)."""


def make_tiny_checkpoint(folder, *, num_layers: int = 3, seed: int = 0, init: float = 0.2):
    """Writes a random-weight Llama checkpoint (HF layout: config.json, model.safetensors,
    tokenizer.json) into `folder` and returns it as a Path.

    Vocabulary: the 256 bytes (byte-level BPE without merges, so text round-trips) plus an
    end-of-sequence token. Weights ~ N(0, init) (0.2 gives peaky logits: greedy argmax is never
    a near-tie) and norm weights ~ 1 + N(0, 0.3), so a norm bug cannot hide behind ones.
    """
    import json
    from pathlib import Path

    import tokenizers
    import torch
    from safetensors.torch import save_file
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    from kvmesh.model.config import ModelConfig
    from kvmesh.model.tokenizer import Tokenizer, _byte_alphabet

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(
        name="tiny-llama", vocab_size=TINY_EOS + 1, hidden_size=64, intermediate_size=128,
        num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=None, eos_token_ids=(TINY_EOS,))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_config()))

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * init

    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    state = {"model.embed_tokens.weight": rand(cfg.vocab_size, h),
             "model.norm.weight": 1 + 0.3 * torch.randn(h, generator=gen),
             "lm_head.weight": rand(cfg.vocab_size, h)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rand(cfg.num_heads * cfg.head_dim, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, cfg.num_heads * cfg.head_dim),
            p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": rand(cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": rand(h, cfg.intermediate_size),
            p + "input_layernorm.weight": 1 + 0.3 * torch.randn(h, generator=gen),
            p + "post_attention_layernorm.weight": 1 + 0.3 * torch.randn(h, generator=gen),
        })
    save_file(state, str(folder / "model.safetensors"))

    alphabet = _byte_alphabet()
    backend = tokenizers.Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|eos|>", special=True)])
    Tokenizer(backend, bos_token_id=None, eos_token_ids=[TINY_EOS], chat_template=None).save_hf(folder)
    return folder


def load_tiny(folder, **kw):
    """`kvmesh.model.loader.load_model` of a tiny checkpoint, fp32 on CPU."""
    from kvmesh.model.loader import load_model

    return load_model(str(folder), dtype="float32", device="cpu", progress=False, **kw)


class ServedEngine:
    """An EngineCore behind a real gRPC server on port 0 (see `serve_engine`)."""

    def __init__(self, engine, stub, address: str) -> None:
        self.engine, self.stub, self.address = engine, stub, address

    async def collect(self, request, timeout: float = 60):
        """Every message of one Generate stream."""
        return [m async for m in self.stub.Generate(request, timeout=timeout)]


def serve_engine(core):
    """Async context manager: `core` on its step-loop thread, served on 127.0.0.1:<free port>
    with the shared interceptors; yields a ServedEngine and tears everything down after."""
    import contextlib

    from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
    from rpc_utils import served
    from kvmesh.services.engine.async_engine import AsyncEngine
    from kvmesh.services.engine.servicer import EngineServicer, model_info

    service = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name

    @contextlib.asynccontextmanager
    async def served_engine():
        engine = AsyncEngine(lambda: core)
        servicer = EngineServicer(engine, model_info(core, EngineConfig()))
        try:
            async with served("engine", lambda s: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, s),
                              service) as srv:
                yield ServedEngine(engine, engine_pb2_grpc.EngineServiceStub(srv.channel), srv.address)
        finally:
            engine.shutdown()

    return served_engine()


class StepGate:
    """Holds the step loop of a served `core` between steps: every `core.step()` waits for a
    permit (`allow`) until `open()`. A test then moves the engine by counted steps, not by time.
    Call `open()` before the engine shuts down (its loop must reach the stop)."""

    def __init__(self, core) -> None:
        self.held = threading.Event()
        """Set while a step waits for its permit (no step runs; none is half done)."""
        self._permits = threading.Semaphore(0)
        self._open = False
        step = core.step

        def gated():
            if not self._open:
                self.held.set()
                self._permits.acquire()
                self.held.clear()
            return step()

        core.step = gated

    def allow(self, steps: int = 1) -> None:
        """Lets `steps` more steps run."""
        for _ in range(steps):
            self._permits.release()

    def open(self) -> None:
        """Lets every step run from now on."""
        self._open = True
        self._permits.release()


# ---- a scriptable fake draft service (kvmesh.draft.v1) for speculative decoding tests -----------

class FakeDraftService:
    """An in-process DraftService on 127.0.0.1:<port> (a plain gRPC server on its own threads,
    so a synchronous EngineCore and an AsyncEngine can both call it).

    It keeps per-sequence histories exactly as the protocol says (new tokens appended, checked
    against committed_len, `needs_resync` on a mismatch, `resync` replaces) and drafts with
    `propose(request_id, history, max_draft_tokens) -> list[int]` (request id = the part of
    the sequence id after the engine instance). Knobs, all deterministic: `fail` (a status code
    every call answers with), `fail_next` (status codes the next calls answer with, one each:
    DEADLINE_EXCEEDED stands for a late answer), `hold_answers()` (calls wait until
    `release_answers()`: late past any deadline, without a race against one). Records every
    request in `calls` and released ids in `released`; `wait_for` blocks until the calls the
    engine does not wait for (Release) have arrived. `stop()` / `start()` kill it and bring it
    back on the same port, empty.
    """

    def __init__(self, propose=None, port: int = 0) -> None:
        self.propose = propose or (lambda rid, history, k: [])
        self.fail = None
        self.fail_next: list = []
        self.calls: list = []
        self.released: list[str] = []
        self.histories: dict[str, list[int]] = {}
        self.drafters = [draft_pb2.DRAFTER_NGRAM, draft_pb2.DRAFTER_MODEL, draft_pb2.DRAFTER_ADAPTIVE]
        """What GetInfo says the service offers."""
        self.target_model = ""
        """What GetInfo says the drafts are for ("" = not said)."""
        self.port = port
        self._server = None
        self._changed = threading.Condition()  # notified on every call and release
        self._answering = threading.Event()
        self._answering.set()
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        self.histories = {}
        server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
        draft_pb2_grpc.add_DraftServiceServicer_to_server(_FakeDraftServicer(self), server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self._server = server

    def stop(self) -> None:
        self.release_answers()  # a held call would keep its worker thread (and the process) alive
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None

    def hold_answers(self) -> None:
        """Propose calls from now on wait for `release_answers` before they answer."""
        self._answering.clear()

    def release_answers(self) -> None:
        self._answering.set()

    def wait_for(self, condition, timeout: float = 10.0) -> bool:
        """Blocks until `condition(self)` holds (checked at every call and release it receives);
        the timeout only bounds a failing test."""
        with self._changed:
            return self._changed.wait_for(lambda: condition(self), timeout)

    def proposed_lengths(self) -> list[list[int]]:
        """max_draft_tokens of every sequence of every call so far."""
        return [[s.max_draft_tokens for s in c.sequences] for c in self.calls]


class _FakeDraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, fake: FakeDraftService) -> None:
        self.fake = fake

    def Propose(self, request, context):
        fake = self.fake
        with fake._changed:
            fake.calls.append(request)
            fail = fake.fail_next.pop(0) if fake.fail_next else fake.fail
            fake._changed.notify_all()
        fake._answering.wait()
        if fail is not None:
            context.abort(fail, "scripted failure")
        out = draft_pb2.ProposeResponse()
        for s in request.sequences:
            if s.resync:
                history = list(s.resync)
            else:
                history = fake.histories.get(s.sequence_id, []) + list(s.new_token_ids)
            if len(history) != s.committed_len:
                out.drafts.add(sequence_id=s.sequence_id, needs_resync=True)
                continue
            fake.histories[s.sequence_id] = history
            rid = s.sequence_id.split("/", 1)[1]
            tokens = list(fake.propose(rid, history, s.max_draft_tokens))[:s.max_draft_tokens]
            out.drafts.add(sequence_id=s.sequence_id, token_ids=tokens, drafter=s.drafter)
        return out

    def Release(self, request, context):
        fake = self.fake
        with fake._changed:
            fake.released.extend(request.sequence_ids)
            n = sum(fake.histories.pop(i, None) is not None for i in request.sequence_ids)
            fake._changed.notify_all()
        return draft_pb2.ReleaseResponse(released=n)

    def GetInfo(self, request, context):
        return draft_pb2.GetInfoResponse(drafters=self.fake.drafters, target_model=self.fake.target_model)


def oracle_drafts(prompts: dict[str, list[int]], outputs: dict[str, list[int]], wrong_at=None):
    """A `FakeDraftService.propose` that continues each request with its known greedy output
    (the target's own continuation, so every draft is accepted). `wrong_at`: draft indexes
    made wrong (token + 1 mod 256)."""
    def propose(rid, history, k):
        full = prompts[rid] + outputs[rid]
        if history != full[:len(history)]:
            return []
        drafts = full[len(history):len(history) + k]
        return [(t + 1) % 256 if wrong_at and i in wrong_at else t for i, t in enumerate(drafts)]
    return propose
