"""Speculation settings, their wiring into the core, the proto mapping and the metrics."""
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.config import ConfigError, load_config
from kvmesh.engine.v1 import engine_pb2
from kvmesh.errors import InvalidArgument
from kvmesh.services.engine import metrics
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.servicer import speculation_from_proto
from kvmesh.services.engine.speculation import SpecMode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_settings_from_flags_and_environment():
    cfg = load_config(EngineConfig, "engine", ["--spec-max-draft-tokens", "6"], environ={
        "KVMESH_ENGINE_DRAFT_ADDRESS": "10.0.0.5:50081", "KVMESH_ENGINE_SPECULATION": "adaptive",
        "KVMESH_ENGINE_DRAFT_TIMEOUT_S": "0.05", "KVMESH_ENGINE_DRAFT_RETRY_S": "1"})
    assert (cfg.draft_address, cfg.speculation, cfg.spec_max_draft_tokens) == ("10.0.0.5:50081", "adaptive", 6)
    assert (cfg.draft_timeout_s, cfg.draft_retry_s) == (0.05, 1.0)
    default = load_config(EngineConfig, "engine", [], environ={})
    assert (default.draft_address, default.speculation, default.spec_max_draft_tokens) == (None, "adaptive", 7)
    with pytest.raises(ConfigError, match="KVMESH_ENGINE_SPECULATION"):
        load_config(EngineConfig, "engine", [], environ={"KVMESH_ENGINE_SPECULATION": "always"})
    with pytest.raises(ConfigError, match="spec-max-draft-tokens"):
        load_config(EngineConfig, "engine", ["--spec-max-draft-tokens", "0"], environ={})


def test_core_wiring(tiny):
    assert make_core(tiny).drafts is None
    fake = FakeDraftService()
    try:
        core = make_core(tiny, draft_address=fake.address, speculation="model", spec_max_draft_tokens=3)
        assert core.speculator.config.default_mode is SpecMode.MODEL and core.speculator.config.max_draft_tokens == 3
        assert core.drafts.target_model == tiny.weights_digest
        assert core.drafts.vocab_size == tiny.config.vocab_size
        core.drafts.close()
    finally:
        fake.stop()


def test_speculation_from_proto():
    assert speculation_from_proto(engine_pb2.SPECULATION_UNSPECIFIED) is None
    assert speculation_from_proto(engine_pb2.SPECULATION_OFF) is SpecMode.OFF
    assert speculation_from_proto(engine_pb2.SPECULATION_ADAPTIVE) is SpecMode.ADAPTIVE
    with pytest.raises(InvalidArgument, match="SPECULATION_OFF"):
        speculation_from_proto(7)


def test_metrics(tiny):
    fake = FakeDraftService(lambda rid, history, k: [history[-1]] * k)
    try:
        core = make_core(tiny, draft_address=fake.address, draft_timeout_s=5.0)
        seen = []
        core.drafts.on_propose = seen.append
        run_all(core, {"a": list(range(1, 30))}, greedy(12, ignore_eos=True))
    finally:
        fake.stop()
    registry = CollectorRegistry()
    registry.register(metrics.CoreCollector(core))
    text = generate_latest(registry).decode()
    totals = core.spec_totals
    assert f"kvmesh_engine_spec_decode_num_draft_tokens_total {float(totals.draft_tokens)}" in text
    assert f"kvmesh_engine_spec_decode_num_accepted_tokens_total {float(totals.accepted_tokens)}" in text
    assert "kvmesh_engine_spec_draft_failures_total 0.0" in text
    assert totals.draft_tokens > 0 and len(seen) == core.drafts.stats.calls and all(s > 0 for s in seen)


def test_the_engine_asks_for_its_own_draft_length(tiny):
    # The engine owns the draft length: every Propose asks for at most --spec-max-draft-tokens per
    # sequence (and never past max_tokens), and carries no step time for the service to price with.
    fake = FakeDraftService(propose=lambda rid, history, k: [])  # never drafts: plain steps only
    try:
        core = make_core(tiny, draft_address=fake.address, speculation="ngram", spec_max_draft_tokens=3)
        run_all(core, {"a": [5, 6, 7, 8]}, greedy(max_tokens=6))
        core.drafts.close()
    finally:
        fake.stop()
    asked = [s.max_draft_tokens for c in fake.calls for s in c.sequences]
    assert asked and all(1 <= k <= 3 for k in asked)
    assert "target_step_s" not in {f.name for f in fake.calls[0].DESCRIPTOR.fields}
