"""The draft service killed mid-run, as real processes on the real model: the engine keeps
serving (plain decoding, same greedy output), and speculates again once the service is back."""
from __future__ import annotations

import os
import signal

import grpc
import pytest

from kvmesh import launcher
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from kvmesh.model.loader import load_tokenizer

pytestmark = pytest.mark.slow

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
           "single step. All that glitters is not gold. Actions speak louder than words.")


# Requests after the draft service is back within which one must have speculated: one takes
# ~0.3 s here, so 30 span many 0.5 s back-offs (--draft-retry-s), and a slower machine makes
# each request longer, not the back-off.
MAX_REQUESTS_TO_RESUME = 30


def _request(tok, speculation) -> engine_pb2.GenerateRequest:
    text = f"Repeat this text exactly, twice:\n\n{PASSAGE}"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), speculation=speculation,
                                      sampling=engine_pb2.SamplingParams(max_tokens=80, temperature=0.0))


def _generate(address: str, req, on_token=None) -> tuple[list[int], engine_pb2.Final]:
    tokens, final = [], None
    with grpc.insecure_channel(address) as ch:
        for msg in engine_pb2_grpc.EngineServiceStub(ch).Generate(req, timeout=300):
            tokens.extend(msg.delta.token_ids)
            if on_token is not None:
                on_token(len(tokens))
            if msg.HasField("final"):
                final = msg.final
    return tokens, final


def test_engine_survives_the_draft_service_and_recovers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_DATA_DIR", str(tmp_path))
    tok = load_tokenizer("bundled")
    draft_port = launcher.free_port()
    draft_args = ["--default-drafter", "ngram", "--draft-model", "none"]  # n-gram only: quick to start
    one = {"OMP_NUM_THREADS": "1"}
    draft = launcher.start_service("draft", "kvmesh.services.draft", draft_args, draft_port, env=one)
    engine = launcher.start_service(
        "engine", "kvmesh.services.engine",
        ["--draft-address", draft.address, "--draft-retry-s", "0.5", "--kv-cache-bytes", str(64 << 20)],
        launcher.free_port())
    try:
        reference, off = _generate(engine.address, _request(tok, engine_pb2.SPECULATION_OFF))
        assert off.spec_steps == 0
        spec, final = _generate(engine.address, _request(tok, engine_pb2.SPECULATION_NGRAM))
        assert spec == reference                                 # lossless
        assert final.spec_steps > 0 and final.accepted_draft_tokens > 0

        killed = []

        def kill_after_a_few(n: int) -> None:
            if n >= 8 and not killed:
                os.kill(draft.pid, signal.SIGKILL)              # mid-stream, no goodbye
                killed.append(n)

        during, _ = _generate(engine.address, _request(tok, engine_pb2.SPECULATION_NGRAM), kill_after_a_few)
        assert killed and during == reference                   # the request finished, same tokens
        after, final = _generate(engine.address, _request(tok, engine_pb2.SPECULATION_NGRAM))
        assert after == reference and final.accepted_draft_tokens == 0   # plain decoding meanwhile

        draft = launcher.start_service("draft", "kvmesh.services.draft", draft_args, draft_port, env=one)
        # Speculation resumes by itself, but not necessarily in the first request: the engine's
        # channel reconnects on its own back-off (at most --draft-retry-s), and a Propose that
        # fails meanwhile turns calls off for --draft-retry-s, longer than one of these requests
        # takes. Counted in requests, not seconds: each must still give the reference tokens.
        accepted = []
        for _ in range(MAX_REQUESTS_TO_RESUME):
            back, final = _generate(engine.address, _request(tok, engine_pb2.SPECULATION_NGRAM))
            assert back == reference
            accepted.append(final.accepted_draft_tokens)
            if final.accepted_draft_tokens > 0:
                break
        assert accepted[-1] > 0, f"no drafts accepted in {len(accepted)} requests after the restart"
    finally:
        launcher.stop_service(engine)
        launcher.stop_service(draft)
