"""The draft service over gRPC on port 0: a mixed Propose batch (n-gram, model on the tiny
random-weight model, adaptive), resync and Release, GetInfo, FAILED_PRECONDITION and
INVALID_ARGUMENT; and the process: it announces its port, serves, and drains on SIGTERM."""
from __future__ import annotations

import asyncio
import signal
import sys
import threading

import grpc
import pytest

from draft_utils import (DRAFT_SERVICE, TARGET, draft_config, greedy_reference, ngram_reference, propose,
                         seq, serving_draft)
from engine_utils import load_tiny, make_tiny_checkpoint
from kvmesh.draft.v1 import draft_pb2 as pb
from kvmesh.draft.v1 import draft_pb2_grpc
from kvmesh.rpc.client import wait_for_ready

REPEAT = [10, 20, 30, 40, 10, 20, 30, 40, 10, 20]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_tiny(tiny_folder)


@pytest.fixture
async def served(tiny):
    async with serving_draft(draft_config(target_model="", block_size=4, kv_cache_bytes=1 << 20), tiny) as d:
        yield d


async def test_a_mixed_batch_then_increments_and_release(served, tiny):
    prompt = [7, 3, 250, 11, 9]
    resp = await served.stub.Propose(propose([
        seq("e/ngram", REPEAT, k=5),
        seq("e/model", prompt, k=3, drafter=pb.DRAFTER_MODEL),
        seq("e/adaptive", REPEAT, k=8, drafter=pb.DRAFTER_ADAPTIVE),
        seq("e/default", [1, 2, 3], k=2, drafter=pb.DRAFTER_UNSPECIFIED),
    ], target_model=tiny.weights_digest), timeout=30)
    ngram, model, adaptive, default = resp.drafts
    assert [d.sequence_id for d in resp.drafts] == ["e/ngram", "e/model", "e/adaptive", "e/default"]
    assert (ngram.drafter, list(ngram.token_ids)) == (pb.DRAFTER_NGRAM, [30, 40, 10, 20, 30])
    assert list(ngram.token_ids) == ngram_reference(REPEAT, 2, 4, 5)
    expected, logprobs = greedy_reference(tiny, prompt, 3)
    assert (model.drafter, list(model.token_ids)) == (pb.DRAFTER_MODEL, expected)
    assert list(model.logprobs) == pytest.approx(logprobs, abs=1e-4)
    assert (adaptive.drafter, list(adaptive.token_ids)) == (pb.DRAFTER_NGRAM, ngram_reference(REPEAT, 2, 4, 8))
    assert default.drafter == pb.DRAFTER_ADAPTIVE and not default.token_ids  # nothing pays

    # the engine accepted one model draft, then its own token; the service rolls back and goes on
    history = prompt + expected[:1] + [0]
    [model] = (await served.stub.Propose(propose([
        seq("e/model", expected[:1] + [0], committed=len(history), k=4, drafter=pb.DRAFTER_MODEL,
            last_accepted=1)]), timeout=30)).drafts
    assert list(model.token_ids) == greedy_reference(tiny, history, 4)[0]

    released = await served.stub.Release(pb.ReleaseRequest(sequence_ids=["e/model", "e/ngram", "x"]),
                                         timeout=10)
    assert released.released == 2
    [again] = (await served.stub.Propose(propose([seq("e/model", [5], committed=len(history) + 1)]),
                                         timeout=10)).drafts
    assert again.needs_resync and not again.token_ids
    [again] = (await served.stub.Propose(propose([seq("e/model", [], resync=history + [5], k=2,
                                                      drafter=pb.DRAFTER_MODEL)]), timeout=30)).drafts
    assert list(again.token_ids) == greedy_reference(tiny, history + [5], 2)[0]


async def test_get_info(served, tiny):
    info = await served.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert list(info.drafters) == [pb.DRAFTER_NGRAM, pb.DRAFTER_MODEL, pb.DRAFTER_ADAPTIVE]
    assert info.target_model == tiny.weights_digest
    assert info.model_drafter == f"{tiny.source} fp32, 3 layers"


async def test_another_target_model_is_a_failed_precondition(served):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await served.stub.Propose(propose([seq("a", [1])], target_model="f" * 64), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "f" * 64 in err.value.details() and "empty target_model to skip" in err.value.details()


@pytest.mark.parametrize("bad, message", [
    (seq("", [1]), "sequence_id is empty"),
    (seq("a", [1], drafter=9), "unknown drafter 9; use one of DRAFTER_NGRAM (1)"),
    (seq("a", [1], k=17), "max_draft_tokens 17 exceeds this service's limit of 16"),
    (seq("a", [1, 257]), "token id 257 is outside the vocabulary"),
])
async def test_bad_input_is_invalid_argument(served, bad, message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await served.stub.Propose(propose([bad]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


async def test_a_call_whose_deadline_passed_in_the_queue_does_no_work():
    async with serving_draft(draft_config()) as d:
        service, gate, entered = d.servicer.service, threading.Event(), threading.Event()
        original = service.propose

        def held(requests, target_model=""):
            entered.set()
            gate.wait(10)  # holds the worker thread, as a long model step would
            return original(requests, target_model)

        service.propose = held
        first = asyncio.ensure_future(d.stub.Propose(propose([seq("first", [1])]), timeout=20))
        assert await asyncio.to_thread(entered.wait, 10)   # "first" holds the worker now
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await d.stub.Propose(propose([seq("late", [1])]), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.set()
        await first
        service.propose = original
        await d.stub.Propose(propose([seq("after", [1])]), timeout=10)  # behind the skipped one
        assert "first" in service.store and "after" in service.store
        assert "late" not in service.store


async def test_an_ngram_only_service_refuses_the_model_drafter():
    async with serving_draft(draft_config()) as d:
        info = await d.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
        assert (list(info.drafters), info.target_model, info.model_drafter) == \
            ([pb.DRAFTER_NGRAM, pb.DRAFTER_ADAPTIVE], TARGET, "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await d.stub.Propose(propose([seq("a", [1], drafter=pb.DRAFTER_MODEL)]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--draft-model" in err.value.details()


async def test_the_process_serves_and_drains_on_sigterm(tiny_folder, tiny):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvmesh.services.draft", "--port", "0", "--draft-model", str(tiny_folder),
        "--draft-weights", "fp32", "--sweep-interval-s", "0.05", "--kv-cache-bytes", "1048576",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert line.startswith("kvmesh-draft listening on 127.0.0.1:"), line
        channel = grpc.aio.insecure_channel(line.split()[-1])
        await wait_for_ready(channel, timeout=10, service=DRAFT_SERVICE)
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        resp = await stub.Propose(propose([seq("p", [7, 3, 250], k=2, drafter=pb.DRAFTER_MODEL)],
                                          target_model=tiny.weights_digest), timeout=30)
        await channel.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert list(resp.drafts[0].token_ids) == greedy_reference(tiny, [7, 3, 250], 2)[0]
