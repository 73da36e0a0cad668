"""--step-target-ms: the token budget of steps that carry decodes, from a line fitted to the
engine's own step times (kvmesh.services.engine.step_budget), through the scheduler and the core.
Time is the test's: synthetic step durations, or a clock the runner advances by a cost model."""
import time

import pytest

from engine_utils import greedy, load_tiny, make_core, make_tiny_checkpoint
from fake_clock import FakeClock
from kvmesh.services.engine.block_manager import BlockManager
from kvmesh.services.engine.core import EngineRequest
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.services.engine.sequence import Sequence
from kvmesh.services.engine.step_budget import MIN_PREFILL_TOKENS, WINDOW, StepBudget


def line(a, b):
    return lambda tokens: a + b * tokens


def test_the_fitted_line_sets_the_budget_within_the_target():
    sb = StepBudget(target_s=0.121, max_tokens=512)
    assert sb.cost() is None and sb.budget(4) == 512  # nothing measured yet: the configured budget
    cost = line(0.010, 0.002)
    for tokens in (5, 300, 40, 512, 9, 128):
        sb.observe(tokens, cost(tokens))
    a, b = sb.cost()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)
    assert sb.budget(4) == int((0.121 - a) / b)  # 55: what fits in 121 ms on this line
    assert cost(sb.budget(4)) <= 0.121 < cost(sb.budget(4) + 1)
    assert StepBudget(target_s=10.0, max_tokens=512).budget(4) == 512
    roomy = StepBudget(target_s=10.0, max_tokens=512)
    for tokens in (5, 300):
        roomy.observe(tokens, cost(tokens))
    assert roomy.budget(4) == 512  # never above --max-num-batched-tokens


def test_one_step_size_only_gives_the_mean_time_per_token():
    sb = StepBudget(target_s=0.101, max_tokens=512)
    for _ in range(5):
        sb.observe(256, 0.64)  # 2.5 ms a token
    assert sb.cost() == (0.0, pytest.approx(0.0025))
    assert sb.budget(3) == 40


def test_a_target_below_one_decode_step_still_leaves_prompts_some_tokens():
    sb = StepBudget(target_s=0.005, max_tokens=64)
    for tokens in (1, 8, 64):
        sb.observe(tokens, line(0.009, 0.002)(tokens))  # a decode step alone takes 9 ms
    assert sb.budget(6) == 6 + MIN_PREFILL_TOKENS
    assert sb.budget(60) == 64  # the floor itself never passes --max-num-batched-tokens


def test_a_negative_intercept_falls_back_to_the_line_through_the_origin():
    sb = StepBudget(target_s=0.1, max_tokens=512)
    sb.observe(10, 0.001)
    sb.observe(100, 0.5)  # steep: the fitted intercept would be negative
    a, b = sb.cost()
    assert a == 0.0 and b == pytest.approx(0.501 / 110)
    assert sb.budget(1) == int(0.1 / b)


def test_the_window_forgets_old_steps():
    sb = StepBudget(target_s=0.2005, max_tokens=4096)
    for tokens in (10, 500) * 10:
        sb.observe(tokens, line(0.05, 0.004)(tokens))  # a slow spell
    slow = sb.budget(2)
    for tokens in (10, 500) * (WINDOW // 2):
        sb.observe(tokens, line(0.01, 0.001)(tokens))  # then WINDOW steps at the normal pace
    assert slow == int((0.2005 - 0.05) / 0.004)
    assert sb.budget(2) == int((0.2005 - 0.01) / 0.001)


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="step target must be > 0"):
        StepBudget(target_s=0.0, max_tokens=10)
    with pytest.raises(ValueError, match="step_target_s must be >= 0"):
        SchedulerConfig(max_model_len=128, block_size=16, step_target_s=-0.1)


def _seq(rid, n, max_tokens=50):
    return Sequence(rid, [(31 * i + len(rid)) % 1000 for i in range(n)], SamplingParams(max_tokens=max_tokens))


def test_the_scheduler_caps_steps_with_decodes_and_keeps_the_solo_budget_without():
    config = SchedulerConfig(max_num_batched_tokens=256, solo_prefill_tokens=1024, max_model_len=4096,
                             block_size=16, step_target_s=0.1)
    sched = Scheduler(config, BlockManager(400, 16))
    cost = line(0.01, 0.0031)  # 29 tokens fit in 100 ms

    def step():
        out = sched.schedule()
        sched.commit(out)
        for item in out.scheduled:
            if item.needs_sampling:
                item.seq.append_token(7)
        sched.observe_step(out.num_batched_tokens, cost(out.num_batched_tokens))
        return [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled]

    a = _seq("a", 1500)
    sched.add(a)
    assert step() == [("a", 1024)]  # alone: the solo budget, the target does not apply
    assert step() == [("a", 476)]   # a's first token: it decodes from now on
    b = _seq("bb", 600)  # not a prefix of a's prompt (the ids seed the tokens)
    sched.add(b)
    budget = int((0.1 - 0.01) / 0.0031)
    assert step() == [("a", 1), ("bb", budget - 1)]
    assert cost(budget) <= 0.1
    off = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=4096, block_size=16),
                    BlockManager(400, 16))
    assert off.timed_budget is None
    off.observe_step(256, 5.0)  # nothing to record: off changes nothing
    off.add(_seq("c", 300))
    assert [i.num_new_tokens for i in off.schedule().scheduled] == [256]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_the_core_times_its_steps_with_its_clock_and_shrinks_the_chunks(tiny):
    """--step-target-ms through EngineConfig and build_core: the runner advances the injected
    clock by a known cost per token, so the budget the core's measurements give is known."""
    clock = FakeClock()
    core = make_core(tiny, num_blocks=128, block_size=16, max_num_batched_tokens=128, solo_prefill_tokens=0,
                     step_target_ms=50.5, draft_clock=clock)
    execute, cost, chunks = core.runner.execute, line(0.002, 0.001), []

    def timed_execute(out):
        clock.advance(cost(out.num_batched_tokens))
        chunks.append({i.seq.request_id: i.num_new_tokens for i in out.scheduled})
        return execute(out)

    core.runner.execute = timed_execute
    now = time.monotonic()
    core.add_request(EngineRequest("a", [(5 * i) % 256 for i in range(20)], greedy(40, ignore_eos=True), now))
    core.step()  # a's prompt (20 tokens) and first token: from here on a decodes
    core.step()  # a decode alone: a second step size, so the line is fitted
    core.add_request(EngineRequest("b", [(3 * i) % 256 for i in range(400)], greedy(2, ignore_eos=True), now))
    while "b" not in chunks[-1] or core.scheduler.get("b").num_output_tokens == 0:
        core.step()
    b_chunks = [c["b"] for c in chunks if "b" in c and "a" in c]
    fits = int((0.0505 - 0.002) / 0.001)  # 48 tokens a step: a's decode and 47 of b's prompt
    assert b_chunks[:-1] == [fits - 1] * (len(b_chunks) - 1) and 0 < b_chunks[-1] <= fits - 1
    assert sum(c["b"] for c in chunks if "b" in c) == 400


def test_the_budget_is_a_metric_only_with_a_target(tiny):
    from kvmesh.services.engine.metrics import CoreCollector

    def metrics(core):
        return {m.name: m for m in CoreCollector(core).collect()}

    assert "kvmesh_engine_step_budget_tokens" not in metrics(make_core(tiny, num_blocks=32))
    clock = FakeClock()
    core = make_core(tiny, num_blocks=32, block_size=16, max_num_batched_tokens=128, step_target_ms=10.0,
                     draft_clock=clock)
    gauge = lambda: metrics(core)["kvmesh_engine_step_budget_tokens"].samples[0].value  # noqa: E731
    assert gauge() == 128  # nothing measured yet: the configured budget
    core.scheduler.observe_step(100, 0.1)  # 1 ms a token: 10 fit in the target
    assert gauge() == MIN_PREFILL_TOKENS  # above 10: no decode running, the floor is 16 tokens
