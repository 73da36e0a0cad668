"""Fuzz-test fixtures: how many cases each test sends.

Every fuzz test runs in two profiles, as the parameter of `n_cases`:

- `fast` (the default, in CI): a few hundred derandomized cases per API, the same ones every run,
  so a failure reproduces and the whole directory stays well under a minute;
- `full`: 10,000 cases per API (KVMESH_FUZZ_CASES to change it; minutes), marked `fuzz_full`
  and skipped unless KVMESH_FUZZ_FULL=1. It is not `slow`: that marker means "loads the real
  model", and CI runs `slow` tests, while the full fuzz run is for a person to start on purpose:

      KVMESH_FUZZ_FULL=1 .venv/bin/pytest tests/fuzz -m fuzz_full -s -p no:cacheprovider

`-s` shows the answers counted by status. The cases are the same every run (Hypothesis
derandomized, no example database); schemathesis's also depend on PYTHONHASHSEED, so set it to
replay a run exactly. Counts can still differ a little where a service's answer depends on time
or on unseeded sampling (TTLs, the engine's random draws).
"""
from __future__ import annotations

import pytest

from fuzz.grpc_fuzz import FAST_CASES, FULL, FULL_CASES


@pytest.fixture(params=[
    pytest.param(FAST_CASES, id="fast"),
    pytest.param(FULL_CASES, id="full", marks=[
        pytest.mark.fuzz_full,
        pytest.mark.skipif(not FULL, reason="the 10,000-case fuzz run; set KVMESH_FUZZ_FULL=1 to run it")]),
])
def n_cases(request) -> int:
    """Cases a fuzz test sends to the API it tests."""
    return request.param
