"""Shared by the chaos tests that load an engine directly: 16 concurrent greedy streams and the
check that a disturbed run failed nothing and changed no output."""
from __future__ import annotations

import asyncio
import statistics

import grpc

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc

STREAMS = 16
MAX_TOKENS = 16
KV_TIMEOUT_S = 1.0


async def run_all(address: str, prompts) -> list:
    request = lambda ids: engine_pb2.GenerateRequest(  # noqa: E731
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=engine_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        async def one(ids):
            tokens, final = [], None
            async for m in stub.Generate(request(ids), timeout=300):
                tokens += m.delta.token_ids
                if m.HasField("final"):
                    final = m.final
            return tokens, final

        return await asyncio.gather(*(one(ids) for ids in prompts), return_exceptions=True)


def check(phase: str, results, reference) -> list[float]:
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{phase}: {len(failed)} of {len(results)} requests failed: {failed[0]!r}"
    assert [r[0] for r in results] == [r[0] for r in reference], f"{phase}: outputs changed"
    ttfts = sorted(r[1].ttft_s for r in results)
    print(f"{phase}: 0 of {len(results)} failed, outputs equal; TTFT min/median/max "
          f"{ttfts[0]:.2f}/{statistics.median(ttfts):.2f}/{ttfts[-1]:.2f} s")
    return ttfts
