"""A clock tests advance by hand, for code that takes `clock=time.monotonic`: time passes when
the test says, so nothing asserts or waits on the wall clock."""
from __future__ import annotations


class FakeClock:
    """A settable monotonic clock (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
