"""Fault injection under load: the draft service hung (SIGSTOP), killed (SIGKILL) and replaced
by one that answers garbage, while 16 greedy streams speculate on an engine (real processes, the
bundled model). The bound the README's reliability table states: 0 requests fail and every
output equals the undisturbed run's -- a late, failed or nonsensical Propose only costs the
speedup (the engine decodes without drafts, and verification rejects wrong drafts)."""
from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from chaos_utils import check, run_all
from kvmesh import launcher
from kvmesh.draft.v1 import draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.slow


class GarbageDrafts(draft_pb2_grpc.DraftServiceServicer):
    """A DraftService that answers every Propose with nonsense: random token ids (in and out of
    the vocabulary), far more than asked, answers for sequences nobody asked about, missing
    ones, spurious needs_resync and drafter values no enum has. Seeded: the same nonsense every
    run."""

    def __init__(self) -> None:
        self.rng = random.Random(19)
        self.proposes = 0

    def Propose(self, request, context):
        self.proposes += 1
        rng = self.rng
        out = draft_pb2.ProposeResponse()
        for s in request.sequences:
            kind = rng.random()
            if kind < 0.1:
                continue  # no answer for this one
            d = out.drafts.add(sequence_id=s.sequence_id if kind > 0.2 else f"nobody/{rng.random()}",
                               needs_resync=rng.random() < 0.1, drafter=rng.randrange(0, 1 << 20))
            n = rng.choice([0, 1, s.max_draft_tokens, s.max_draft_tokens + 50, 400])
            d.token_ids.extend(rng.randrange(0, 49152) if rng.random() < 0.9 else rng.randrange(49152, 1 << 32)
                               for _ in range(n))
            d.logprobs.extend(rng.uniform(-1e9, 1e9) for _ in range(rng.randrange(0, 3)))
        return out

    def Release(self, request, context):
        return draft_pb2.ReleaseResponse(released=len(request.sequence_ids) * 7)

    def GetInfo(self, request, context):
        return draft_pb2.GetInfoResponse(drafters=[draft_pb2.DRAFTER_NGRAM, draft_pb2.DRAFTER_MODEL])


async def test_the_draft_service_hung_killed_or_answering_garbage_fails_no_request(tmp_path, monkeypatch, long_prompts):
    monkeypatch.setenv("KVMESH_DATA_DIR", str(tmp_path))
    draft_port = launcher.free_port()
    draft_args = ["--default-drafter", "ngram", "--draft-model", "none", "--threads", "1"]
    draft = launcher.start_service("draft", "kvmesh.services.draft", draft_args, draft_port,
                                   env={"OMP_NUM_THREADS": "1"})
    engine, garbage_server = None, None
    try:
        engine = launcher.start_service(
            "engine", "kvmesh.services.engine",
            # Every sequence gets drafts in every decode step (--spec-batch-draft-tokens), however
            # the 16 streams' prefills happen to group them; a first Propose slowed by a loaded
            # machine still lands (--draft-timeout-s).
            ["--draft-address", draft.address, "--speculation", "ngram", "--draft-retry-s", "0.5",
             "--draft-timeout-s", "0.5", "--spec-batch-draft-tokens", "2", "--kv-cache-bytes", str(64 << 20)],
            launcher.free_port())
        reference = await run_all(engine.address, long_prompts)
        check("drafts from the draft service", reference, reference)
        assert sum(r[1].draft_tokens for r in reference) > 0  # it really speculated

        os.kill(draft.pid, signal.SIGSTOP)
        hung = await run_all(engine.address, long_prompts)
        check("draft service SIGSTOPped", hung, reference)
        os.kill(draft.pid, signal.SIGCONT)

        os.kill(draft.pid, signal.SIGKILL)
        check("draft service SIGKILLed", await run_all(engine.address, long_prompts), reference)

        garbage = GarbageDrafts()  # on the dead service's port: the engine reconnects to it
        garbage_server = grpc.server(ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        draft_pb2_grpc.add_DraftServiceServicer_to_server(garbage, garbage_server)
        assert garbage_server.add_insecure_port(f"127.0.0.1:{draft_port}") == draft_port
        garbage_server.start()
        nonsense = await run_all(engine.address, long_prompts)
        check("draft service answering garbage", nonsense, reference)
        assert garbage.proposes > 0 and sum(r[1].draft_tokens for r in nonsense) > 0  # garbage was verified
        assert launcher.health(engine.address) == "SERVING"
    finally:
        if engine is not None:
            launcher.stop_service(engine, timeout_s=5)
        if garbage_server is not None:
            garbage_server.stop(grace=None)
        if launcher.alive(draft.pid):
            os.kill(draft.pid, signal.SIGCONT)
        launcher.stop_service(draft, timeout_s=5)
