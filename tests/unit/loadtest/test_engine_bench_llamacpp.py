"""The llama.cpp columns of `kvmesh bench engine` without llama.cpp: llama-server's command line and
context sizing for a plan, where the binary is looked for, the skip line when it is absent, the
/completion request and the parsing of a canned response into rows. One test starts the real
llama-server on the bundled GGUF, skipped when scripts/build-llamacpp.sh has not built it."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kvmesh.loadtest import engine_bench as eb

ROOT = Path(__file__).resolve().parents[3]

# A /completion response of llama-server (stream off), trimmed to the fields around the ones read.
CANNED = {
    "index": 0, "content": " the cat sat", "tokens": [], "id_slot": 0, "stop": True, "model": "m.gguf",
    "tokens_predicted": 32, "tokens_evaluated": 128, "stop_type": "limit", "truncated": False,
    "timings": {"cache_n": 0, "prompt_n": 128, "prompt_ms": 250.0, "prompt_per_token_ms": 1.953,
                "prompt_per_second": 512.0, "predicted_n": 32, "predicted_ms": 620.0,
                "predicted_per_token_ms": 20.0, "predicted_per_second": 50.0},
}


def _flags(cmd: list[str]) -> dict[str, str]:
    return {k: v for k, v in zip(cmd[1:], cmd[2:]) if k.startswith("-") and not v.startswith("-")}


def test_server_slots_hold_the_longest_request_in_every_slot():
    assert eb.server_slots(eb.FULL) == (32, 4096)  # the 2048-token TTFT prompt + 1 needs 2049
    assert eb.server_slots(eb.QUICK) == (32, 4096)
    tiny = eb.Plan(decode_prompt=8, decode_tokens=4, ttft_prompts=(8,), repeats=1, concurrency=(1, 2),
                   conc_prompt=8, conc_tokens=4)
    assert eb.server_slots(tiny) == (2, 256)  # never below 256, llama.cpp's per-sequence padding
    assert eb.server_slots(eb.Plan(ttft_prompts=(4096,), concurrency=(1, 4))) == (4, 8192)
    assert eb.server_slots(eb.Plan(ttft_prompts=(300,), conc_prompt=1000, conc_tokens=24)) == (32, 1024)


def test_llama_server_command_for_the_full_plan():
    cmd = eb.llama_server_command(Path("/opt/llama-server"), Path("/m/model.gguf"), eb.FULL, 8123, 16)
    assert cmd[0] == "/opt/llama-server"
    assert "--cont-batching" in cmd
    flags = _flags(cmd)
    assert flags["-m"] == "/m/model.gguf"
    assert (flags["--host"], flags["--port"]) == ("127.0.0.1", "8123")
    assert (flags["-t"], flags["-tb"]) == ("16", "16")
    assert flags["--parallel"] == "32"
    assert flags["--cache-ram"] == "0"
    assert int(flags["-c"]) == 32 * 4096
    assert int(flags["-c"]) // int(flags["--parallel"]) >= eb.longest_sequence(eb.FULL)


def test_completion_body_is_greedy_and_uncached():
    body = eb.completion_body((5, 6, 7), 4)
    assert body == {"prompt": [5, 6, 7], "n_predict": 4, "temperature": 0, "top_k": 1,
                    "cache_prompt": False, "ignore_eos": True, "stream": False}


def test_canned_response_to_rows():
    done = eb.parse_completion(CANNED)
    assert done == eb.Completion(tokens=32, prompt_n=128, prompt_ms=250.0, predicted_n=32, predicted_ms=620.0)
    assert done.decode_tok_s == pytest.approx(50.0)  # 31 decode steps in 620 ms: predicted_per_second
    ttft = eb.ttft_row([done, eb.Completion(32, 128, 350.0, 32, 620.0)], 128)
    assert ttft == {"system": "llamacpp-server", "prompt_tokens": 128, "metric": "ttft_s",
                    "value": pytest.approx(0.3), "unit": "s"}
    tput = eb.throughput_row([done] * 8, 2.0, 8)
    assert tput == {"system": "llamacpp-server", "concurrency": 8, "metric": "throughput_tok_s",
                    "value": pytest.approx(128.0), "unit": "tok/s"}


def test_decode_rows_carry_the_spread():
    rows = eb.decode_rows([30.0, 10.0, 20.0], "llamacpp")
    assert [(r["metric"], r["value"]) for r in rows] == [
        ("decode_tok_s", 20.0), ("decode_tok_s_min", 10.0), ("decode_tok_s_max", 30.0)]
    assert all(r["system"] == "llamacpp" and r["concurrency"] == 1 and r["unit"] == "tok/s" for r in rows)


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_llama_server_path(tmp_path):
    built = _exe(tmp_path / "cache" / "llamacpp" / eb.LLAMACPP_VERSION / "bin" / "llama-server")
    assert eb.llama_server_path({"KVMESH_CACHE_DIR": str(tmp_path / "cache")}) == built
    assert eb.llama_server_path({"KVMESH_CACHE_DIR": str(tmp_path / "other")}) is None
    own = _exe(tmp_path / "elsewhere" / "llama-server")
    assert eb.llama_server_path({eb.LLAMA_SERVER_ENV: str(own), "KVMESH_CACHE_DIR": str(tmp_path / "cache")}) == own
    # the variable names the binary: a wrong one is not silently replaced by the cached build
    assert eb.llama_server_path({eb.LLAMA_SERVER_ENV: str(tmp_path / "nope"),
                                 "KVMESH_CACHE_DIR": str(tmp_path / "cache")}) is None
    (tmp_path / "plain").write_text("")
    assert eb.llama_server_path({eb.LLAMA_SERVER_ENV: str(tmp_path / "plain")}) is None  # not executable


def test_missing_llama_cpp_skips_each_column_with_one_line_naming_the_script(tmp_path, monkeypatch, capsys):
    env = {eb.LLAMA_SERVER_ENV: str(tmp_path / "absent")}
    skip = eb.llamacpp_skip_reasons(env, have_llama_cpp=False)
    assert set(skip) == {"llamacpp", "llamacpp-server"}
    ran = []
    monkeypatch.setattr(eb, "bench_llamacpp", lambda *a: ran.append("llamacpp") or [])
    monkeypatch.setattr(eb, "bench_llamacpp_server", lambda *a: ran.append("server") or [])
    assert eb.llamacpp_columns(eb.QUICK, None, Path("m.gguf"), skip) == []
    assert ran == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("bash scripts/build-llamacpp.sh" in line for line in lines)

    # llama-cpp-python there, the server not built: only the server column is skipped
    monkeypatch.setattr(eb, "bench_llamacpp", lambda *a: [{"system": "llamacpp"}])
    skip = eb.llamacpp_skip_reasons(env, have_llama_cpp=True)
    assert list(skip) == ["llamacpp-server"]
    assert eb.llamacpp_columns(eb.QUICK, None, Path("m.gguf"), skip) == [{"system": "llamacpp"}]
    assert "llama-server is not built" in capsys.readouterr().err

    # both there: library column first, then the server
    order = []
    monkeypatch.setattr(eb, "bench_llamacpp", lambda *a: order.append("llamacpp") or [])
    monkeypatch.setattr(eb, "bench_llamacpp_server", lambda *a: order.append("server") or [])
    eb.llamacpp_columns(eb.QUICK, None, Path("m.gguf"), {})
    assert order == ["llamacpp", "server"]


def test_a_server_that_exits_early_is_a_clear_error():
    class Exited:
        returncode = 1

        def poll(self):
            return 1

    with pytest.raises(RuntimeError, match=r"exited with status 1 before it was ready:\nerror: bad model"):
        eb.wait_ready(client=None, proc=Exited(), deadline_s=60, log_tail=lambda: "error: bad model")


def test_bench_server_without_a_binary_names_the_script(tmp_path, monkeypatch):
    monkeypatch.setenv(eb.LLAMA_SERVER_ENV, str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="bash scripts/build-llamacpp.sh"):
        eb.bench_llamacpp_server(eb.QUICK, None, Path("m.gguf"))


def test_the_version_is_pinned_alike_everywhere():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    assert extra == [f"llama-cpp-python=={eb.LLAMACPP_VERSION}"]
    script = (ROOT / "scripts" / "build-llamacpp.sh").read_text()
    assert re.search(r'VERSION="\$\{LLAMA_CPP_PYTHON_VERSION:-([0-9.]+)\}"', script)[1] == eb.LLAMACPP_VERSION
    assert "-DGGML_AMX_TILE=OFF" in script and "-DGGML_AMX_INT8=OFF" in script and "-DGGML_AMX_BF16=OFF" in script


@pytest.mark.skipif(eb.llama_server_path() is None, reason="llama-server not built (bash scripts/build-llamacpp.sh)")
def test_llama_server_generates_four_greedy_tokens_on_the_bundled_gguf():
    import subprocess

    import httpx

    from kvmesh import launcher
    from kvmesh.model.loader import bundled_gguf_path

    plan = eb.Plan(decode_prompt=8, decode_tokens=4, ttft_prompts=(8,), repeats=1, concurrency=(1,),
                   conc_prompt=8, conc_tokens=4)
    port = launcher.free_port()
    cmd = eb.llama_server_command(eb.llama_server_path(), bundled_gguf_path(), plan, port, 1)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0) as client:
            eb.wait_ready(client, proc, 120.0)
            r = client.post("/completion", json=eb.completion_body([1, 504, 3458, 282, 1], 4))
            r.raise_for_status()
            done = eb.parse_completion(r.json())
    finally:
        eb._stop(proc)
    assert done.tokens == 4 and done.predicted_n == 4 and done.prompt_n == 5
