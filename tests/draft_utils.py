"""Test helpers for the draft service: reference drafters (from scratch, no state), request
builders, and the service on a real gRPC server on port 0.

    async with serving_draft(draft_config(draft_model=None)) as d:
        resp = await d.stub.Propose(propose([seq("a", [1, 2, 3, 1, 2], k=3)]), timeout=10)
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from kvmesh.draft.v1 import draft_pb2 as pb
from kvmesh.draft.v1 import draft_pb2_grpc
from rpc_utils import served
from kvmesh.rpc.server import ServerSettings
from kvmesh.services.draft.build import build_service
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.draft.servicer import DraftServicer
from kvmesh.telemetry import Telemetry

DRAFT_SERVICE = pb.DESCRIPTOR.services_by_name["DraftService"].full_name
TARGET = "0" * 64
"""target_model of test services that have no draft model (any fixed digest will do)."""


def ngram_reference(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup by brute force: the longest suffix n-gram (n_max down to n_min) that occurs
    earlier, its latest such occurrence, and up to k tokens after it, continuing into the copy
    itself past the end of the history."""
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = list(tokens[end - n:])
        for start in range(end - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[start + n + i])
                return ext[end:]
    return []


def greedy_reference(loaded, context: Sequence[int], k: int, block_size: int = 16
                     ) -> tuple[list[int], list[float]]:
    """k greedy tokens of `loaded` after `context` and their log-probabilities, one sequence
    through the paged forward from a fresh KV cache: one prefill of the whole context, then one
    decode step per token."""
    import torch

    from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache

    model, dev = loaded.model, loaded.device
    nblocks = -(-(len(context) + k) // block_size)
    kv = allocate_kv_cache(loaded.config, nblocks, block_size, loaded.dtype, dev)
    table = torch.arange(nblocks, device=dev)[None]  # [1, nblocks]: the sequence owns them all

    logprobs: list[float] = []

    def step(ids: list[int], start: int) -> int:
        pos = torch.arange(start, start + len(ids), device=dev)
        meta = AttentionMetadata.build(pos.clone(), [len(ids)], [start + len(ids)], table, block_size)
        hidden = model(torch.tensor(ids, device=dev), pos, kv, meta)  # [T, hidden]
        logits = model.compute_logits(hidden[-1:])[0]  # [vocab] float32
        logprobs.append(float(torch.log_softmax(logits, -1).max()))
        return int(logits.argmax())

    with torch.inference_mode():
        out = [step(list(context), 0)]
        for _ in range(k - 1):
            out.append(step([out[-1]], len(context) + len(out) - 1))
    return out, logprobs


def draft_config(**overrides) -> DraftConfig:
    """A DraftConfig for tests: port 0, no draft model, TARGET as the target, unless overridden."""
    base = dict(server=ServerSettings(port=0), draft_model=None, target_model=TARGET, sweep_interval_s=0.0)
    return DraftConfig(**{**base, **overrides})


def seq(sequence_id: str, new: Sequence[int], *, committed: int | None = None, k: int = 4,
        drafter: int = pb.DRAFTER_NGRAM, resync: Sequence[int] = (),
        last_accepted: int | None = None) -> pb.SequenceDraftRequest:
    """One SequenceDraftRequest; `committed` defaults to len(new) (a first call), or len(resync)."""
    if committed is None:
        committed = len(resync) if resync else len(new)
    msg = pb.SequenceDraftRequest(sequence_id=sequence_id, new_token_ids=list(new), committed_len=committed,
                                  resync=list(resync), max_draft_tokens=k, drafter=drafter)
    if last_accepted is not None:
        msg.last_accepted = last_accepted
    return msg


def propose(sequences: Sequence[pb.SequenceDraftRequest], target_model: str = "") -> pb.ProposeRequest:
    return pb.ProposeRequest(sequences=list(sequences), target_model=target_model)


@dataclass
class ServedDraft:
    address: str
    stub: draft_pb2_grpc.DraftServiceStub
    servicer: DraftServicer


@contextlib.asynccontextmanager
async def serving_draft(cfg: DraftConfig, loaded=None) -> AsyncIterator[ServedDraft]:
    """The draft service for `cfg` (and draft model `loaded`, if any) on 127.0.0.1:<free port>
    with the shared interceptors; yields it with a client stub, then drains it."""
    telemetry = Telemetry.create("kvmesh-draft")
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-test-worker")
    servicer = DraftServicer(build_service(cfg, loaded, metrics=DraftMetrics(telemetry.registry)),
                             worker)
    try:
        async with served("draft", lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
                          DRAFT_SERVICE, telemetry=telemetry) as srv:
            yield ServedDraft(srv.address, draft_pb2_grpc.DraftServiceStub(srv.channel), servicer)
    finally:
        worker.shutdown(wait=True)
