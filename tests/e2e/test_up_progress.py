"""`kvmesh up` on the terminal: a line per service as it becomes healthy, and when one cannot
start, that service's own message (its last log lines), never a Python traceback. No model is
loaded: the failing service is the second one started (the draft service, behind the KV service)."""
from __future__ import annotations

import os
import subprocess
import sys

from kvmesh import launcher


def test_up_shows_progress_then_the_failing_services_own_error(tmp_path):
    env = {**os.environ, "KVMESH_DATA_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    ports = [f"--{svc}-port={launcher.free_port()}"
             for svc in ("http", "gateway", "router", "engine", "kvcache", "draft")]
    up = subprocess.run([sys.executable, "-m", "kvmesh.cli", "up", *ports, "--metrics-port=-1",
                         "--draft-arg=--no-such-flag=1"],
                        env=env, capture_output=True, text=True, timeout=300)
    terminal = up.stdout + up.stderr
    assert up.returncode == 1, terminal
    assert "kvcache      healthy on 127.0.0.1:" in up.stdout, terminal  # the one before it came up
    # the draft service's own argparse-style message, as it printed it
    assert "draft exited with code 2 during start" in up.stderr, terminal
    assert "python -m kvmesh.services.draft: error: unknown flag --no-such-flag" in up.stderr, terminal
    assert "Traceback" not in terminal, terminal
    assert not (tmp_path / "stack.json").exists()  # nothing left recorded as running
