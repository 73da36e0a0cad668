"""TTFT of `kvmesh bench quality`: full prefill against blending at each recompute ratio, through
real engine processes over gRPC (the measurement is described in kvmesh.loadtest.quality_bench's
docstring)."""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time

from kvmesh.loadtest.blend_bench import generate
from kvmesh.loadtest.quality_workloads import QualityPrompt
from kvmesh.threads import usable_cores

WARM_RATIO = 0.33
"""The untimed pass's ratio: one no timed pass uses, so no timed prompt meets its own blended
blocks in the engine's prefix cache."""
SALT = "quality"


def _parts(p: QualityPrompt):
    from kvmesh.common.v1.common_pb2 import TokenIds
    from kvmesh.engine.v1 import engine_pb2 as pb

    return pb.Prompt(parts=[pb.PromptPart(document=TokenIds(ids=ids)) if is_doc else
                            pb.PromptPart(tokens=TokenIds(ids=ids)) for ids, is_doc in p.segments])


async def _first_token(stub, *, salt: str, ids=None, parts=None, ratio=None) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens whose KV came from blended documents)."""
    first, _, final = await generate(stub, salt=salt, ids=ids, parts=parts, ratio=ratio, max_tokens=1)
    return first, final.blended_tokens


async def _full_ttft(address: str, prompts: list[QualityPrompt], warm: list[int]) -> list[float]:
    import grpc

    from kvmesh.engine.v1 import engine_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        await _first_token(stub, salt="warm", ids=warm)
        # A salt per prompt: prompts that share a long prefix (one document, two questions) must
        # not hit each other's blocks in the engine's prefix cache -- this is full prefill.
        return [(await _first_token(stub, salt=f"{SALT}-full-{i}", ids=p.token_ids))[0]
                for i, p in enumerate(prompts)]


async def _blend_ttft(address: str, prompts: list[QualityPrompt], ratios, warm: list[int]) -> dict[float, list[float]]:
    import grpc

    from kvmesh.common.v1.common_pb2 import TokenIds
    from kvmesh.engine.v1 import engine_pb2 as pb
    from kvmesh.engine.v1 import engine_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        await _first_token(stub, salt="warm", ids=warm)
        docs = dict(d for p in prompts for d in p.document_segments())
        t0 = time.perf_counter()
        for doc_id, ids in docs.items():
            await stub.IngestDocument(pb.IngestDocumentRequest(document_id=doc_id, token_ids=TokenIds(ids=ids),
                                                               cache_salt=SALT), timeout=600)
        print(f"ingested {len(docs)} documents in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for p in prompts:
            await _first_token(stub, salt=SALT, parts=_parts(p), ratio=WARM_RATIO)
        out: dict[float, list[float]] = {}
        for ratio in ratios:
            for p in prompts:
                seconds, blended = await _first_token(stub, salt=SALT, parts=_parts(p), ratio=ratio)
                if not blended:  # a fallback to computing the documents would time the wrong path
                    raise RuntimeError(f"{p.id} at recompute_ratio {ratio} was not blended; see the engine's log")
                out.setdefault(ratio, []).append(seconds)
        return out


def measure_ttft(prompts: list[QualityPrompt], ratios, warm: list[int],
                 engine_args: list[str] = ()) -> tuple[list[float], dict[float, list[float]]]:
    """Full prefill and blending TTFT through engine processes (see the module docstring):
    (full prefill seconds per prompt, {ratio: blend seconds per prompt}). `engine_args` name the
    model (kvmesh.loadtest.models.BenchModel.engine_args)."""
    from kvmesh import launcher

    threads = str(usable_cores())
    print(f"TTFT: {len(prompts)} prompts of {min(len(p.token_ids) for p in prompts)}-"
          f"{max(len(p.token_ids) for p in prompts)} tokens", file=sys.stderr)
    engine = launcher.start_service("bench-engine", "kvmesh.services.engine", ["--threads", threads, *engine_args],
                                    launcher.free_port())
    try:
        full = asyncio.run(_full_ttft(engine.address, prompts, warm))
    finally:
        launcher.stop_service(engine)
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-quality-") as tmp:
        try:
            kv = launcher.start_service("bench-kvcache", "kvmesh.services.kvcache", ["--data-dir", tmp],
                                        launcher.free_port(), env={"OMP_NUM_THREADS": "1"})
            procs.append(kv)
            # No guardrail shadow checks: they run when the engine idles (between these requests)
            # and could switch blending off mid-measurement.
            procs.append(launcher.start_service("bench-engine", "kvmesh.services.engine",
                                                ["--threads", threads, "--kvcache-address", kv.address,
                                                 "--guard-shadow-share", "0", *engine_args], launcher.free_port()))
            blends = asyncio.run(_blend_ttft(procs[-1].address, prompts, ratios, warm))
        finally:
            for p in reversed(procs):
                launcher.stop_service(p)
    for ratio, secs in blends.items():
        print(f"TTFT blend={ratio:g}: " + " ".join(f"{b:.2f}/{f:.2f}s" for b, f in zip(secs, full)), file=sys.stderr)
    return full, blends
