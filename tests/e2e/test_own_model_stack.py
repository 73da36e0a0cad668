"""`kvmesh up --model <dir>` on a model of another family than the bundled one (a tiny random
Qwen2 made by scripts/make_tiny_model.py), end to end through the openai SDK, and a gateway given
another model's tokenizer refusing to start against that stack."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvmesh import launcher
from kvmesh.model.bundled import source_tokenizer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _hf_greedy(folder: Path, ids: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in eos:
                break
    return out[len(ids):]


def test_up_serves_a_tiny_qwen2_and_a_mismatched_gateway_refuses(tmp_path):
    env = {**os.environ, "KVMESH_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    model = tmp_path / "tiny-qwen2"
    made = _run(str(REPO / "scripts" / "make_tiny_model.py"), str(model), "--family", "qwen2", env=env)
    assert made.returncode == 0, made.stderr
    other = tmp_path / "tiny-llama"
    assert _run(str(REPO / "scripts" / "make_tiny_model.py"), str(other), "--family", "llama",
                env=env).returncode == 0

    ports = {svc: launcher.free_port() for svc in ("http", "gateway", "router", "engine", "kvcache", "draft")}
    up = _run("-m", "kvmesh.cli", "up", "--model", str(model), "--served-model-name", "tiny-qwen2",
              *(f"--{svc}-port={p}" for svc, p in ports.items()), "--engine-arg=--kv-cache-bytes=16777216",
              "--engine-arg=--threads=1", env=env)
    assert up.returncode == 0, up.stderr
    try:
        base = f"http://127.0.0.1:{ports['http']}/v1"
        with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120) as client:
            # the served model, then the KV service's embedding model (POST /v1/embeddings)
            assert [(m.id, m.kind) for m in client.models.list().data] == [
                ("tiny-qwen2", "generation"), ("all-MiniLM-L6-v2", "embedding")]
            assert len(client.embeddings.create(model="all-MiniLM-L6-v2", input="cache").data[0].embedding) == 384
            chat = client.chat.completions.create(model="tiny-qwen2", max_tokens=8, temperature=0,
                                                  messages=[{"role": "user", "content": "Hello there"}])
            assert chat.model == "tiny-qwen2" and chat.usage.completion_tokens >= 1
            tok = source_tokenizer(str(model))
            prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
            assert chat.usage.prompt_tokens == len(tok.encode(prompt))  # ChatML from tokenizer_config.json
            tokenized = httpx.post(base.removesuffix("/v1") + "/tokenize", timeout=60, json={
                "model": "tiny-qwen2", "messages": [{"role": "user", "content": "Hello there"}]}).json()
            assert tokenized["tokens"] == tok.encode(prompt)  # the gateway's /tokenize, as vLLM's
            want = _hf_greedy(model, tok.encode(prompt), 8, tok.eos_token_ids)
            assert chat.choices[0].message.content == tok.decode(want)  # transformers' greedy answer
            stream = client.completions.create(model="tiny-qwen2", prompt="The cache", max_tokens=6,
                                               temperature=0, stream=True)
            text = "".join(c.choices[0].text for c in stream if c.choices)
            assert text == tok.decode(_hf_greedy(model, tok.encode("The cache"), 6, tok.eos_token_ids))

        # A gateway tokenizing with another model's tokenizer refuses to start against these engines.
        refused = _run("-m", "kvmesh.services.gateway", "--model", str(other), "--router-address",
                       f"127.0.0.1:{ports['router']}", "--http-port", "0", "--port", "0", env=env, timeout=120)
        assert refused.returncode != 0
        assert f"tier 'tiny-qwen2' serves model 'tiny-qwen2' (engine --model {model})" in refused.stderr
        assert f"--model {other}" in refused.stderr
    finally:
        down = _run("-m", "kvmesh.cli", "down", env=env)
    assert down.returncode == 0
