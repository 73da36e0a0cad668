"""SpecGate: each step's arm for ADAPTIVE requests, from measured throughput (exact)."""
from __future__ import annotations

import pytest

from kvmesh.services.engine.spec_gate import PLAIN, Arm, SpecGate, default_arms
from kvmesh.services.engine.speculation import SpecMode

NGRAM1, NGRAM3, NGRAM7 = Arm(SpecMode.NGRAM, 1), Arm(SpecMode.NGRAM, 3), Arm(SpecMode.NGRAM, 7)
ADAPT3, ADAPT7 = Arm(SpecMode.ADAPTIVE, 3), Arm(SpecMode.ADAPTIVE, 7)


def run(gate: SpecGate, batch: int, steps: int, arms: dict, outlier_every: int = 0) -> list[Arm]:
    """Drives the gate with steps whose outcome depends only on the arm: `arms[arm]` is
    (seconds per step, tokens of successive steps, cycled). With `outlier_every`, every such
    step takes 20x as long."""
    chosen, seen = [], {a: 0 for a in arms}
    for i in range(1, steps + 1):
        arm = gate.choose(batch)
        chosen.append(arm)
        secs, tokens = arms[arm]
        tok = tokens[seen[arm] % len(tokens)]
        seen[arm] += 1
        gate.record(batch, arm, tokens=tok, seconds=secs * (20 if outlier_every and i % outlier_every == 0 else 1))
    return chosen


def steady(rate: float) -> tuple[float, list[int]]:
    """One token per step at `rate` tokens per second (an exact binary step time for 128, 64...)."""
    return (1 / rate, [1])


def time_share(chosen: list[Arm], arms: dict, arm: Arm) -> float:
    total = sum(arms[a][0] for a in chosen)
    return sum(arms[a][0] for a in chosen if a == arm) / total


def test_default_arms_and_bad_settings():
    assert default_arms(7) == (PLAIN, NGRAM1, NGRAM3, NGRAM7, ADAPT7)
    assert default_arms(3) == (PLAIN, NGRAM1, NGRAM3, ADAPT3)
    assert default_arms(2) == (PLAIN, NGRAM1, Arm(SpecMode.NGRAM, 2), Arm(SpecMode.ADAPTIVE, 2))
    assert default_arms(7, lengths=(3,)) == (PLAIN, NGRAM3, NGRAM7, ADAPT7)
    assert default_arms(0) == (PLAIN,)
    with pytest.raises(ValueError):
        SpecGate((PLAIN, PLAIN))
    with pytest.raises(ValueError):
        SpecGate(explore_share=1.0)
    with pytest.raises(ValueError):
        SpecGate(window=1)


def achieved(chosen: list[Arm], arms: dict) -> float:
    """Tokens per second of the steps run (as `run` ran them)."""
    seen, tokens, seconds = {a: 0 for a in arms}, 0, 0.0
    for a in chosen:
        secs, toks = arms[a]
        tokens += toks[seen[a] % len(toks)]
        seen[a] += 1
        seconds += secs
    return tokens / seconds


def test_warm_up_then_the_fastest_runs_and_clearly_slower_arms_share_five_percent_of_the_time():
    arms = {PLAIN: steady(100.0), NGRAM3: steady(160.0), NGRAM7: steady(120.0), ADAPT7: steady(80.0)}
    gate = SpecGate(tuple(arms), min_steps=2)
    assert gate.current(1) == PLAIN                        # nothing measured yet: no drafts
    chosen = run(gate, batch=1, steps=3000, arms=arms)
    assert chosen[:8] == list(arms) * 2                     # warm-up: the fewest samples first
    assert gate.current(1) == NGRAM3 and gate.current(8) == PLAIN
    explored = [a for a in chosen[8:] if a != NGRAM3]
    assert set(explored) == {PLAIN, NGRAM7, ADAPT7} and len(explored) > 30
    assert 0.04 < 1 - time_share(chosen[8:], arms, NGRAM3) <= 0.05
    assert gate.rates(1) == {a: pytest.approx(1 / secs) for a, (secs, _) in arms.items()}


def test_a_very_slow_arm_costs_at_most_its_share_of_the_time():
    """The draft service's model drafter on this CPU: a step of it takes ~30 plain steps. A
    step-count schedule would give it a third of the time."""
    arms = {PLAIN: steady(100.0), NGRAM3: steady(150.0), ADAPT7: (2.0, [10])}
    chosen = run(SpecGate(tuple(arms)), 1, 5000, arms)
    assert chosen[:4] == [PLAIN, NGRAM3, ADAPT7, PLAIN]     # one slow step is warm-up enough
    assert time_share(chosen, arms, ADAPT7) <= 0.05 / 2 + 2.0 / sum(arms[a][0] for a in chosen)
    assert chosen[1000:].count(NGRAM3) >= 0.97 * 4000


def test_ties_go_to_the_earlier_arm():
    arms = {PLAIN: steady(128.0), NGRAM3: steady(128.0)}
    gate = SpecGate(tuple(arms), min_steps=2)
    for _ in range(50):
        run(gate, 1, 4, arms)
        assert gate.current(1) == PLAIN   # runs, while ngram stays plausible and is explored


@pytest.mark.parametrize("step_cost", [4.2, 3.0, 2.0])
def test_noisy_drafts_take_over_only_when_they_pay(step_cost):
    """A drafting arm emits 1 or 7 tokens a step (4 on average) at `step_cost` plain steps: 5%
    slower than plain at 4.2, 1.33x as fast at 3, 2x at 2. Its noise must not cost more than a
    little against plain, and it must be found when it pays."""
    arms = {PLAIN: steady(128.0), NGRAM7: (step_cost / 128, [1, 7, 7, 1, 1, 7, 1, 7])}
    chosen = run(SpecGate(tuple(arms)), 1, 2000, arms)
    best = max(128.0, 4 * 128.0 / step_cost)
    assert achieved(chosen, arms) >= (0.985 if step_cost > 4 else 0.97) * best


def test_a_rare_stretched_step_does_not_flip_the_choice():
    """One step in 10 takes 20x as long, whichever arm ran (a stalled machine). Capped at twice the
    window's median, the faster arm stays the one that runs; summed as is, ngram's outliers
    would hide that it is 1.25x as fast."""
    arms = {PLAIN: steady(128.0), NGRAM3: steady(160.0)}
    gate = SpecGate(tuple(arms), min_steps=2)
    best = []
    for _ in range(100):
        run(gate, 1, 20, arms, outlier_every=10)
        best.append(gate.current(1))
    assert best[5:] == [NGRAM3] * 95
    window = [arms[NGRAM3][0] * (20 if i % 10 == 0 else 1) for i in range(24)]
    assert 24 / sum(window) < 128.0  # what an uncapped sum of such a window would say


def test_batch_sizes_are_measured_apart_and_the_gate_follows_a_change():
    gate = SpecGate((PLAIN, NGRAM7), explore_share=0.2, window=4)
    assert [SpecGate.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    run(gate, batch=1, steps=40, arms={PLAIN: steady(128.0), NGRAM7: steady(256.0)})
    run(gate, batch=8, steps=40, arms={PLAIN: steady(128.0), NGRAM7: steady(64.0)})
    assert gate.current(1) == NGRAM7 and gate.current(8) == PLAIN
    later = run(gate, batch=8, steps=300, arms={PLAIN: steady(128.0), NGRAM7: steady(512.0)})
    assert later[-40:].count(NGRAM7) >= 36                  # drafting got cheaper: it won back


def test_adaptive_requests_follow_the_arm_and_fixed_modes_do_not(tmp_path):
    import time

    from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint
    from kvmesh.draft.v1 import draft_pb2
    from kvmesh.services.engine.core import EngineRequest

    tiny = load_tiny(make_tiny_checkpoint(tmp_path))
    fake = FakeDraftService(propose=lambda rid, history, k: history[-k:])
    try:
        core = make_core(tiny, draft_address=fake.address, speculation="ngram", spec_max_draft_tokens=4,
                         spec_step_rows=256)
        arms = []

        def choose(batch):   # every other step no drafts, else model drafts of at most 2
            arms.append(PLAIN if len(arms) % 2 == 0 else Arm(SpecMode.MODEL, 2))
            return arms[-1]

        core.speculator.gate = SpecGate((PLAIN, Arm(SpecMode.MODEL, 2)))
        core.speculator.gate.choose = choose
        core.add_request(EngineRequest("a", [5, 6, 7, 8], greedy(12), time.monotonic(), speculation=SpecMode.ADAPTIVE))
        core.add_request(EngineRequest("n", [9, 8, 7, 6], greedy(12), time.monotonic(), speculation=SpecMode.NGRAM))
        while core.has_work:
            core.step()
        core.drafts.close()
    finally:
        fake.stop()
    asked = [{s.sequence_id.split("/")[-1]: s for s in c.sequences} for c in fake.calls]
    a_asks = [ids["a"] for ids in asked if "a" in ids]
    assert PLAIN in arms and a_asks and any("n" in ids and "a" not in ids for ids in asked)
    assert all(q.drafter == draft_pb2.DRAFTER_MODEL and 1 <= q.max_draft_tokens <= 2 for q in a_asks)
    n_asks = [ids["n"] for ids in asked if "n" in ids]
    assert all("n" in ids for ids in asked if ids)                  # NGRAM requests are not gated
    assert len(n_asks) > len(a_asks) and all(q.drafter == draft_pb2.DRAFTER_NGRAM for q in n_asks)
    assert max(q.max_draft_tokens for q in n_asks) == 4              # nor capped by the arm


@pytest.mark.parametrize("local", [True, False])
def test_adaptive_ngram_arms_look_drafts_up_in_the_engine(tmp_path, local):
    """An ADAPTIVE request on an n-gram arm drafts from its own history in the engine: no Propose
    call for it (with spec_local_ngram off: from the service), the same drafts, the same tokens."""
    import time

    from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint
    from kvmesh.ngram import NGRAM_MAX, NGRAM_MIN, NgramIndex
    from kvmesh.services.engine.core import EngineRequest

    def service_ngram(rid, history, k):
        index = NgramIndex(NGRAM_MIN, NGRAM_MAX)
        index.update(history)
        return index.lookup(history, k)

    tiny = load_tiny(make_tiny_checkpoint(tmp_path))
    prompt = [5, 6, 7, 8, 9] * 6
    outputs = {}
    for arm in (PLAIN, NGRAM3):
        fake = FakeDraftService(propose=service_ngram)
        try:
            core = make_core(tiny, draft_address=fake.address, spec_max_draft_tokens=3, spec_step_rows=256,
                             spec_local_ngram=local)
            core.speculator.gate = SpecGate((arm,))
            core.add_request(EngineRequest("a", prompt, greedy(20), time.monotonic(), speculation=SpecMode.ADAPTIVE))
            tokens = []
            while core.has_work:
                for out in core.step():
                    tokens += out.token_ids
            outputs[arm] = (tokens, core.spec_totals.draft_tokens, core.spec_totals.accepted_tokens)
            core.drafts.close()
        finally:
            fake.stop()
        asked = [s for c in fake.calls for s in c.sequences if s.max_draft_tokens > 0]
        if arm == NGRAM3:
            assert (not asked) if local else asked
    (plain, none, _), (spec, drafted, accepted) = outputs[PLAIN], outputs[NGRAM3]
    assert spec == plain and none == 0
    assert drafted > 0 and accepted > 0   # the repeating prompt gives drafts that are accepted


def test_in_process_ngram_range_follows_the_engine_settings(tmp_path):
    """--spec-ngram-min/--spec-ngram-max set the lengths the engine's own lookup matches: a
    history whose only repeated suffix is a bigram drafts at min 2 and not at min 3; min > max is
    refused naming both flags; a request's in-process index gets the range build_core was given."""
    import time

    from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint
    from kvmesh.config import ConfigError
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.engine.core import EngineRequest
    from kvmesh.services.engine.speculator import LocalNgram, SpecConfig

    class History:
        def __init__(self, tokens):
            self.tokens = tokens

        @property
        def num_tokens(self):
            return len(self.tokens)

        def token_ids(self, start, end):
            return self.tokens[start:end]

    history = History([1, 2, 9, 3, 1, 2])          # suffix (1, 2) seen before, (3, 1, 2) never
    assert LocalNgram(2, 4).propose(history, 3)[0] == 9
    assert LocalNgram(3, 4).propose(history, 3) == []
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        SpecConfig(ngram_min=5, ngram_max=4)
    with pytest.raises(ConfigError, match="--spec-ngram-min 5 exceeds --spec-ngram-max 4"):
        EngineConfig(spec_ngram_min=5, spec_ngram_max=4).validate()
    fake = FakeDraftService(propose=lambda rid, history, k: [])
    try:
        core = make_core(load_tiny(make_tiny_checkpoint(tmp_path)), draft_address=fake.address,
                         spec_ngram_min=3, spec_ngram_max=6)
        core.speculator.gate = SpecGate((NGRAM3,))
        core.add_request(EngineRequest("a", [5, 6, 7, 8, 9] * 6, greedy(4), time.monotonic(),
                                       speculation=SpecMode.ADAPTIVE))
        lookups = []
        while core.has_work:
            core.step()
            req = core.speculator._requests.get("a")
            if req is not None and req.ngram is not None:
                lookups.append((req.ngram.index.n_min, req.ngram.index.n_max))
        assert lookups and set(lookups) == {(3, 6)}   # the request's own index took the engine's range
        core.drafts.close()
    finally:
        fake.stop()
