"""The compose stack for real: the image built, a key created the documented way, every service
started and waited on through its healthcheck, then one chat request through the published
gateway (with and without the key) and its trace in Jaeger.

It needs a reachable Docker engine and `docker compose` (v2); without either it skips and says
so, before anything else runs. The same topology is tested as plain processes in
tests/e2e/test_openai_stack.py, and the compose file itself offline in test_compose_file.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from kvmesh.launcher import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "compose"
MODEL = "smollm2-135m-instruct"


def _docker_problem() -> str | None:
    """Why the stack cannot run here, or None. Asks the engine itself (the docker SDK's ping):
    the `docker` client binary alone is not enough."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (it comes with the test extras: pip install -e '.[test]')"
    try:
        client = docker.from_env(timeout=5)
    except Exception as e:  # DockerException, or a malformed DOCKER_HOST
        return f"no Docker engine reachable ({e})"
    try:
        client.ping()
    except Exception as e:
        return f"no Docker engine reachable ({e})"
    finally:
        client.close()
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "a Docker engine is reachable but `docker compose` (v2) is not installed"
    return None


@pytest.fixture(scope="module")
def stack():
    problem = _docker_problem()
    if problem:
        pytest.skip(f"{problem}; the compose stack cannot start (compose/docker-compose.yml is "
                    "still validated offline by test_compose_file.py)")
    from testcontainers.compose import DockerCompose

    ports = {"KVMESH_HTTP_PORT": free_port(), "KVMESH_GRPC_PORT": free_port(), "JAEGER_UI_PORT": free_port()}
    mp = pytest.MonkeyPatch()
    # Its own project: its own network and volumes (removed afterwards), its own image tag.
    mp.setenv("COMPOSE_PROJECT_NAME", f"kvmesh-test-{os.getpid()}")
    mp.setenv("KVMESH_IMAGE", "kvmesh:test")
    for name, port in ports.items():
        mp.setenv(name, str(port))
    compose = DockerCompose(COMPOSE_DIR, compose_file_name="docker-compose.yml", wait=True)

    def run(*args: str) -> str:
        done = subprocess.run([*compose.compose_command_property, *args], cwd=COMPOSE_DIR,
                              capture_output=True, text=True)
        assert done.returncode == 0, f"docker compose {' '.join(args)}:\n{done.stderr[-4000:]}"
        return done.stdout

    try:
        run("build")
        # the README's way: keys are required in this stack, the gateway would not start without
        key = run("run", "--rm", "--no-deps", "-T", "gateway", "python", "-m",
                  "kvmesh.services.gateway.keys", "add", "--tenant", "ci").strip().splitlines()[-1]
        compose.start()  # `up --wait`: returns once every healthcheck passes
        yield {"key": key, "http": ports["KVMESH_HTTP_PORT"], "jaeger": ports["JAEGER_UI_PORT"]}
    finally:
        compose.stop()  # `down --volumes`
        mp.undo()


def test_chat_through_the_published_gateway_needs_a_key_and_is_traced(stack):
    base_url = f"http://127.0.0.1:{stack['http']}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="sk-not-a-key", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base_url, api_key=stack["key"], max_retries=0, timeout=300)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    # Spans leave each service in batches (a few seconds), then pass the collector: poll Jaeger's
    # query API, bounded, since nothing announces their arrival.
    url = f"http://127.0.0.1:{stack['jaeger']}/api/services"
    want = {"kvmesh-gateway", "kvmesh-router", "kvmesh-engine"}
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while not want <= seen and time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as resp:
            seen = set(json.load(resp)["data"] or [])
        time.sleep(2)
    assert want <= seen, f"services with traces in Jaeger: {sorted(seen)}"
