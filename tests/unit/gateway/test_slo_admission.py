"""SLO-aware admission's predictor (services/gateway/slo.py): queued prompt tokens over the rate
measured at first tokens; no refusal without evidence or with nothing waiting; a margin under the
bound; leaving the queue on any end."""
import pytest

from fake_clock import FakeClock
from kvmesh.services.gateway.slo import TtftPredictor


def test_no_prediction_and_no_refusal_until_enough_first_tokens_were_measured():
    p = TtftPredictor(1.0, min_samples=2, clock=FakeClock())
    assert p.predict(10_000) is None and p.refuses(10_000) is None
    h = p.admit(100)
    p.first_token(h)  # zero elapsed time on the fake clock: no sample
    assert p.samples == 0 and p.waiting_tokens == 0


def test_the_rate_is_measured_from_tokens_ahead_plus_own_over_ttft():
    clock = FakeClock()
    p = TtftPredictor(2.0, alpha=0.5, min_samples=2, margin=0.8, clock=clock)
    a = p.admit(300)             # nothing ahead
    b = p.admit(100)             # 300 ahead
    c = p.admit(200)             # 400 ahead
    assert p.waiting_tokens == 600
    clock.advance(1.0)
    p.first_token(a)             # 300 tokens in 1 s
    assert p.samples == 1 and p.rate == pytest.approx(300.0)
    clock.advance(1.0)
    p.first_token(b)             # (300 + 100) in 2 s = 200/s: EWMA(0.5) 250
    clock.advance(1.0)
    p.first_token(c)             # (400 + 200) in 3 s = 200/s: EWMA(0.5) 225
    assert p.rate == pytest.approx(225.0) and p.samples == 3 and p.waiting_tokens == 0
    p.rate = 200.0               # round numbers below
    assert p.predict(1000) == pytest.approx(5.0)
    assert p.refuses(1000) is None  # nothing waiting: refusing would save no queueing delay
    held = p.admit(100)
    assert p.refuses(200) is None                       # 300/200 = 1.5 s <= 0.8 x 2 s
    assert p.refuses(300) == pytest.approx(2.0)         # 400/200 = 2.0 s > 1.6 s: the margin refuses
    assert p.retry_after_s(2.0) == 1 and p.retry_after_s(5.5) == 4
    p.leave(held)                # failed before its first token: it no longer counts
    assert p.waiting_tokens == 0 and p.refuses(300) is None
    p.leave(held)
    p.first_token(held)          # both no-ops now
    assert p.waiting_tokens == 0 and p.samples == 3


def test_the_rate_moves_with_the_measurements():
    clock = FakeClock()
    p = TtftPredictor(2.0, alpha=0.5, min_samples=1, clock=clock)
    for elapsed in (1.0, 4.0):   # 400 tokens: 400/s, then 100/s
        h = p.admit(400)
        clock.advance(elapsed)
        p.first_token(h)
    assert p.rate == pytest.approx(0.5 * 400 + 0.5 * 100)
