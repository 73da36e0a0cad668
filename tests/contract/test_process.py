"""`python -m kvmesh.services.gateway` as a process: announces its ports, serves, drains on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai

from gateway_utils import MODEL, WORDS


def test_process_serves_and_drains_on_sigterm(gateway, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    gateway.tokenizer.save_hf(folder)  # the tiny tokenizer as an HF folder: --model takes it
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.gateway", "--model", str(folder),
         "--router-address", gateway.router_address, "--http-port", "0", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KVMESH_GATEWAY_GRACE_S": "2"})
    try:
        http_line = proc.stdout.readline()
        grpc_line = proc.stdout.readline()
        assert http_line.startswith("kvmesh-gateway http on 127.0.0.1:"), http_line + proc.stderr.read()
        assert grpc_line.startswith("kvmesh-gateway listening on 127.0.0.1:"), grpc_line
        base = f"http://127.0.0.1:{http_line.rsplit(':', 1)[1].strip()}"
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as c:
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "".join(WORDS)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
