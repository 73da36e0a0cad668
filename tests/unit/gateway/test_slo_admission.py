"""SLO-aware admission's predictor (services/gateway/slo.py): queued prompt tokens over the rate
measured at each first token; no refusal without evidence; leaving the queue on any end."""
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
    p = TtftPredictor(2.0, alpha=0.5, min_samples=2, clock=clock)
    a = p.admit(300)             # nothing ahead
    b = p.admit(100)             # 300 ahead
    assert p.waiting_tokens == 400
    clock.advance(1.0)
    p.first_token(a)             # 300 tokens in 1 s
    clock.advance(1.0)
    p.first_token(b)             # (300 + 100) in 2 s = 200/s; EWMA(0.5): 250
    assert p.rate == pytest.approx(250.0) and p.samples == 2 and p.waiting_tokens == 0
    assert p.predict(500) == pytest.approx(2.0) and p.refuses(500) is None   # exactly at the SLO
    held = p.admit(400)
    assert p.predict(200) == pytest.approx(600 / 250) and p.refuses(200) == pytest.approx(2.4)
    assert p.retry_after_s(2.4) == 1 and p.retry_after_s(5.5) == 4
    p.leave(held)                # failed before its first token: it no longer counts
    assert p.waiting_tokens == 0 and p.refuses(200) is None
    p.leave(held)
    p.first_token(held)          # both no-ops now
    assert p.waiting_tokens == 0 and p.samples == 2
