"""AsyncEngine start-up: the core is built on the step-loop thread, and a failed build surfaces."""
import threading
from types import SimpleNamespace

import pytest

from kvmesh.services.engine.async_engine import AsyncEngine


class _IdleCore:
    has_work = False
    sched_config = SimpleNamespace(max_waiting=1, max_num_seqs=1)

    def request_ids(self):
        return []

    def load(self):
        return None


def test_core_is_built_on_the_step_loop_thread_and_build_errors_are_raised():
    seen = {}

    def build():
        seen["thread"] = threading.current_thread().name
        return _IdleCore()

    engine = AsyncEngine(build)
    try:
        assert seen["thread"] == "engine-step-loop" and isinstance(engine.core, _IdleCore)
    finally:
        engine.shutdown()

    def broken():
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        AsyncEngine(broken)
