"""The engine's link to the draft service (kvmesh.draft.v1): one Propose per step, on the step
loop's own thread, for every sequence that speculates in that step."""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import grpc

from kvmesh.draft.v1 import draft_pb2, draft_pb2_grpc
from kvmesh.rpc.client import make_sync_channel
from kvmesh.services.engine.sequence import Sequence
from kvmesh.services.engine.speculation import SpecMode

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0
"""Deadline of a Release or GetInfo call (off the critical path: nothing waits for them)."""

_DRAFTER = {
    SpecMode.NGRAM: draft_pb2.DRAFTER_NGRAM,
    SpecMode.MODEL: draft_pb2.DRAFTER_MODEL,
    SpecMode.ADAPTIVE: draft_pb2.DRAFTER_ADAPTIVE,
}


@dataclass(frozen=True)
class DraftClientConfig:
    """Where the draft service is and how long the engine waits for it."""

    address: str
    """host:port of the draft service."""
    timeout_s: float = 0.1
    """Deadline of one Propose call; a late answer means plain decoding for that step."""
    retry_s: float = 2.0
    """After a failed call, no call for this long (every sequence decodes plainly)."""


@dataclass(frozen=True)
class DraftQuery:
    """One sequence that wants drafts this step."""

    seq: Sequence
    max_draft_tokens: int
    mode: SpecMode


@dataclass
class DraftStats:
    """What the client counted since it started (read by the metrics collector)."""

    calls: int = 0
    """Propose calls made."""
    failures: int = 0
    """Propose calls that failed or missed their deadline (those steps decoded plainly)."""
    resyncs: int = 0
    """Sequences the service asked to resync (its state did not match the engine's)."""
    release_failures: int = 0
    """Release calls that failed (the service drops the state on its own after a TTL)."""


@dataclass
class _SeqState:
    sent: int = 0
    """Committed tokens the service has been sent (and acknowledged) for this sequence."""
    resync: bool = False
    """The service asked for the whole sequence: send it in `resync` next time."""
    last_accepted: Optional[int] = None
    """Drafts accepted at this sequence's last verification, until sent (the service scores it
    against its previous answer; unset when those drafts were not verified)."""


# NOTE: per-sequence state and failures.
#
# The service keeps each sequence's token history, so a call carries only what was committed
# since the last acknowledged call (`_SeqState.sent`) plus the committed length, which lets the
# service detect any disagreement (a lost answer, its restart, an expired state) and answer
# `needs_resync`; the next call then sends the whole sequence in `resync` (one step without
# drafts for that sequence). `sent` moves only on an answer that is not `needs_resync`, so a
# failed or late call changes nothing here: whatever the service did with it, the committed
# length in the next call tells it.
#
# A failed call (error, deadline) costs that step its drafts and turns calls off for `retry_s`,
# so a service that is down costs one deadline per `retry_s`, not one per step. A single late
# answer is forgiven (the next step calls again); two in a row count as slow, and back off. The channel's
# own reconnect back-off is capped at `retry_s` too, so the first call after the service comes
# back finds a connection (or is the one that starts it), and speculation resumes by itself.
#
# Release (finished and aborted sequences) is batched per step and sent without waiting; when
# it fails or is skipped during a back-off the service forgets the state after its TTL.
#
# The service refuses a whole call that names a drafter it does not offer, so the client asks
# GetInfo (without waiting: at start and after every outage) and, once it knows, leaves out the
# sequences of requests whose drafter is not offered (they decode plainly; logged once).


class DraftClient:
    """Calls the draft service from the engine's step loop (synchronous, with a deadline)."""

    def __init__(self, config: DraftClientConfig, *, target_model: str, vocab_size: int,
                 instance_id: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.target_model = target_model
        """Weights digest of the target: the service refuses drafting for another model."""
        self.vocab_size = vocab_size
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        """Prefix of every sequence id: requests of two engines never share service state."""
        self.stats = DraftStats()
        self.on_propose: Optional[Callable[[float], None]] = None
        """Called with the seconds of every Propose call (success or not), e.g. a histogram."""
        self._clock = clock
        backoff_ms = max(100, int(config.retry_s * 1000))
        # Traced: each Propose is a CLIENT span under the request the step loop sets as current.
        self._channel = make_sync_channel(config.address, options=[
            ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 1000)),
            ("grpc.min_reconnect_backoff_ms", min(backoff_ms, 1000)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
        ])
        self._stub = draft_pb2_grpc.DraftServiceStub(self._channel)
        self._connecting = grpc.channel_ready_future(self._channel)  # connect before the first step
        self._seqs: dict[str, _SeqState] = {}
        self._to_release: list[str] = []
        self._retry_at = 0.0
        self._down = False  # failed and backing off (logged once per outage)
        self._late = False  # the last call missed its deadline
        self._offered: Optional[frozenset[int]] = None  # drafters of the service, once known
        self._unoffered_logged: set[SpecMode] = set()
        self._info = self._ask_info()

    def sequence_id(self, request_id: str) -> str:
        return f"{self.instance_id}/{request_id}"

    @property
    def available(self) -> bool:
        """False during the back-off after a failure: `propose` would not call."""
        return self._clock() >= self._retry_at

    def propose(self, queries: list[DraftQuery]) -> dict[Sequence, list[int]]:
        """Drafts for the queried sequences (those that got any). One Propose call with the
        configured deadline; {} without a call during a back-off, or when the call fails."""
        if not self.available:
            return {}
        queries = self._offered_only(queries)
        if not queries:
            return {}
        request = draft_pb2.ProposeRequest(target_model=self.target_model)
        for q in queries:
            state = self._seqs.setdefault(q.seq.request_id, _SeqState())
            n = q.seq.num_tokens
            msg = request.sequences.add(sequence_id=self.sequence_id(q.seq.request_id), committed_len=n,
                                        max_draft_tokens=q.max_draft_tokens, drafter=_DRAFTER[q.mode])
            if state.resync:
                msg.resync.extend(q.seq.token_ids(0, n))
            else:
                msg.new_token_ids.extend(q.seq.token_ids(state.sent, n))
            if state.last_accepted is not None:  # scores the previous answer, once
                msg.last_accepted, state.last_accepted = state.last_accepted, None
        self.stats.calls += 1
        t0 = time.perf_counter()
        try:
            response = self._stub.Propose(request, timeout=self.config.timeout_s)
        except grpc.RpcError as err:
            self._failed(err)
            return {}
        finally:
            if self.on_propose is not None:
                self.on_propose(time.perf_counter() - t0)
        self._late = False
        if self._down:
            log.info("draft service %s answers again; speculative decoding resumed", self.config.address)
            self._down = False
            self._offered, self._info = None, self._ask_info()  # it may have restarted differently
        answers = {d.sequence_id: d for d in response.drafts}
        drafts: dict[Sequence, list[int]] = {}
        for q in queries:
            state = self._seqs[q.seq.request_id]
            answer = answers.get(self.sequence_id(q.seq.request_id))
            if answer is None or answer.needs_resync:
                state.resync = True  # no answer: the service's state is unknown, resend it all
                if answer is not None:
                    self.stats.resyncs += 1
                continue
            state.sent, state.resync = q.seq.num_tokens, False
            tokens = self._valid_prefix(answer.token_ids, q.max_draft_tokens)
            if tokens:
                drafts[q.seq] = tokens
        return drafts

    def accepted(self, request_id: str, num_accepted: int) -> None:
        """Records how many drafts the request accepted at its last verification (sent with
        its next Propose, for the service's adaptive policy)."""
        state = self._seqs.get(request_id)
        if state is not None:
            state.last_accepted = num_accepted

    def release(self, request_id: str) -> None:
        """Forgets a finished or aborted request; the service is told at the next `flush`."""
        if self._seqs.pop(request_id, None) is not None:
            self._to_release.append(self.sequence_id(request_id))

    def flush(self) -> None:
        """Sends the pending releases in one Release call, without waiting for it (skipped
        during a back-off: the service's TTL drops them)."""
        if not self._to_release:
            return
        ids, self._to_release = self._to_release, []
        if not self.available:
            return
        future = self._stub.Release.future(draft_pb2.ReleaseRequest(sequence_ids=ids),
                                           timeout=RELEASE_TIMEOUT_S)
        future.add_done_callback(self._release_done)

    def close(self) -> None:
        self._connecting.cancel()
        self._channel.close()

    def _ask_info(self) -> grpc.Future:
        return self._stub.GetInfo.future(draft_pb2.GetInfoRequest(), timeout=RELEASE_TIMEOUT_S)

    def _offered_only(self, queries: list[DraftQuery]) -> list[DraftQuery]:
        """The queries whose drafter the service offers (all of them while that is unknown)."""
        if self._offered is None and self._info.done():
            try:
                info = self._info.result()
            except grpc.RpcError:
                self._info = self._ask_info() if self.available else self._info
                return queries
            self._offered = frozenset(info.drafters)
            if info.target_model and info.target_model != self.target_model:
                log.error("draft service %s drafts for model %s, not this engine's %s; its calls will "
                          "fail until --draft-address names a service for this model",
                          self.config.address, info.target_model, self.target_model)
        if self._offered is None:
            return queries
        kept = [q for q in queries if _DRAFTER[q.mode] in self._offered]
        for q in queries:
            if _DRAFTER[q.mode] not in self._offered and q.mode not in self._unoffered_logged:
                self._unoffered_logged.add(q.mode)
                log.warning("draft service %s offers no %s drafter; requests asking for it decode "
                            "without drafts", self.config.address, q.mode)
        return kept

    def _release_done(self, future: grpc.Future) -> None:
        if future.exception() is not None:  # on a gRPC thread: count only
            self.stats.release_failures += 1

    def _valid_prefix(self, token_ids, limit: int) -> list[int]:
        """The service's drafts up to the first id outside the vocabulary (never trusted)."""
        out = []
        for t in token_ids[:limit]:
            if t >= self.vocab_size:
                break
            out.append(int(t))
        return out

    def _failed(self, err: grpc.RpcError) -> None:
        self.stats.failures += 1
        code = err.code() if isinstance(err, grpc.Call) else None
        late_once = code is grpc.StatusCode.DEADLINE_EXCEEDED and not self._late
        self._late = code is grpc.StatusCode.DEADLINE_EXCEEDED
        if late_once:  # one late answer (a pause, a catch-up): the next step tries again
            return
        self._retry_at = self._clock() + self.config.retry_s
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            log.error("draft service %s refused drafting (%s: %s); check --draft-address and the "
                      "service's limits. Retrying in %g s", self.config.address, code.name,
                      err.details(), self.config.retry_s)
        elif not self._down:
            log.warning("draft service %s failed (%s); decoding without drafts, retrying every %g s",
                        self.config.address, code.name if code else err, self.config.retry_s)
        self._down = True
