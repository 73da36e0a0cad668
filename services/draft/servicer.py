"""gRPC servicer for kvmesh.draft.v1: protobuf <-> the DraftService, nothing else.

Every call runs on the service's one worker thread (the thread that loaded the draft model: one
OpenMP team, see the engine's threading NOTE), so drafting never blocks the event loop and the
domain sees one call at a time. Errors are kvmesh.errors exceptions; the shared interceptor maps
them to status codes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from opentelemetry import trace

from kvmesh.draft.v1 import draft_pb2 as pb
from kvmesh.draft.v1 import draft_pb2_grpc
from kvmesh.errors import DeadlineExceeded, InvalidArgument
from kvmesh.services.draft.drafters import DrafterKind
from kvmesh.services.draft.service import DraftService, SequenceDraft, SequenceRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

_KINDS = {pb.DRAFTER_NGRAM: DrafterKind.NGRAM, pb.DRAFTER_MODEL: DrafterKind.MODEL,
          pb.DRAFTER_ADAPTIVE: DrafterKind.ADAPTIVE}
_PROTO = {kind: value for value, kind in _KINDS.items()}


def to_kind(value: int, sequence_id: str) -> DrafterKind | None:
    """The domain drafter of a proto enum value (None: unspecified); InvalidArgument if unknown."""
    if value == pb.DRAFTER_UNSPECIFIED:
        return None
    if value not in _KINDS:
        known = ", ".join(f"{pb.Drafter.Name(v)} ({v})" for v in _KINDS)
        raise InvalidArgument(f"sequence {sequence_id!r}: unknown drafter {value}; use one of {known}, "
                              "or leave it unspecified for the service's default")
    return _KINDS[value]


def to_request(msg: pb.SequenceDraftRequest) -> SequenceRequest:
    return SequenceRequest(
        sequence_id=msg.sequence_id, new_token_ids=list(msg.new_token_ids),
        committed_len=msg.committed_len, max_draft_tokens=msg.max_draft_tokens,
        drafter=to_kind(msg.drafter, msg.sequence_id),
        resync=list(msg.resync) if msg.resync else None,
        last_accepted=msg.last_accepted if msg.HasField("last_accepted") else None)


def to_proto(draft: SequenceDraft) -> pb.SequenceDraft:
    return pb.SequenceDraft(sequence_id=draft.sequence_id, token_ids=draft.token_ids,
                            logprobs=draft.logprobs, needs_resync=draft.needs_resync,
                            drafter=_PROTO[draft.drafter])


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Thin adapter from kvmesh.draft.v1 to a DraftService, calls on `worker`'s one thread."""

    def __init__(self, service: DraftService, worker: ThreadPoolExecutor) -> None:
        self.service = service
        self._worker = worker

    async def _run(self, fn: Callable[..., T], *args, context=None) -> T:
        """`fn(*args)` on the worker thread; a call whose deadline passed while it waited for the
        worker is answered DEADLINE_EXCEEDED without doing the work (its caller has moved on)."""
        remaining = context.time_remaining() if context is not None else None
        deadline = None if remaining is None else time.monotonic() + remaining

        def call() -> T:
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded("the call's deadline passed while it waited behind other "
                                       "Propose calls; nothing was drafted (its state is unchanged)")
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._worker, call)

    async def sweep_forever(self, interval_s: float) -> None:
        """Frees expired states every `interval_s` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)  # a schedule, not synchronization
            dropped = await self._run(self.service.sweep)
            if dropped:
                log.info("dropped %d expired sequences", dropped)

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        sequences = [to_request(msg) for msg in request.sequences]
        drafts = await self._run(self.service.propose, sequences, request.target_model, context=context)
        span = trace.get_current_span()
        span.set_attribute("kvmesh.draft.sequences", len(drafts))
        span.set_attribute("kvmesh.draft.proposed_tokens", sum(len(d.token_ids) for d in drafts))
        return pb.ProposeResponse(drafts=[to_proto(d) for d in drafts])

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        released = await self._run(self.service.release, list(request.sequence_ids))
        return pb.ReleaseResponse(released=released)

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        info = self.service.info()
        return pb.GetInfoResponse(drafters=[_PROTO[k] for k in info.drafters],
                                  target_model=info.target_model, model_drafter=info.model_drafter)
