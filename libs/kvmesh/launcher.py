"""Runs the kvmesh topology as local processes: start with readiness waits, stop, status.

State (pids, ports, log paths) lives in `<data dir>/stack.json`; each service logs to
`<data dir>/logs/<service>.log`. The data directory is $KVMESH_DATA_DIR or ~/.kvmesh.
"""
from __future__ import annotations

import functools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.model.bundled import BUNDLED_NAME


def data_dir() -> Path:
    return Path(os.environ.get("KVMESH_DATA_DIR", Path.home() / ".kvmesh"))


@dataclass(frozen=True)
class ServiceProc:
    """One running service process of the local stack."""

    name: str
    pid: int
    address: str
    log: str
    url: str = ""
    restarts: int = 0
    """Times the supervisor started it again after it exited (kvmesh.supervisor)."""
    last_exit: str = ""
    """How it last exited while the stack was up ('killed by SIGKILL after 12s'), or ''."""


class LaunchError(RuntimeError):
    """A service did not come up; the message says which and where its log is."""


def _state_path() -> Path:
    return data_dir() / "stack.json"


def load_state() -> list[ServiceProc]:
    try:
        return [ServiceProc(**p) for p in json.loads(_state_path().read_text())]
    except FileNotFoundError:
        return []


def write_json_atomic(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    tmp.replace(path)


def _supervisor_path() -> Path:
    return data_dir() / "supervisor.json"


def supervisor_pid() -> int | None:
    """The running stack's supervisor process, or None."""
    try:
        pid = int(json.loads(_supervisor_path().read_text())["pid"])
    except (FileNotFoundError, ValueError, KeyError):
        return None
    return pid if alive(pid) else None


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on `host` (for tests and benchmarks that start services)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def health(address: str, timeout_s: float = 2.0) -> str:
    """The gRPC health status of a service ('SERVING', 'NOT_SERVING', or 'UNREACHABLE')."""
    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def start_service(name: str, module: str, args: list[str], port: int, *,
                  host: str = "127.0.0.1", env: dict[str, str] | None = None,
                  ready_timeout_s: float = 300.0) -> ServiceProc:
    """Starts `python -m module args` detached, waits until its gRPC health says SERVING."""
    logs = data_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", host, "--port", str(port), *args],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True)
    address = f"{host}:{port}"
    svc = ServiceProc(name, proc.pid, address, str(log_path))
    deadline = time.monotonic() + ready_timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise LaunchError(f"{name} exited with code {proc.returncode} during start; see {log_path}")
            left = deadline - time.monotonic()
            if left <= 0:
                proc.terminate()
                raise LaunchError(f"{name} not ready after {ready_timeout_s:.0f}s; see {log_path}")
            try:
                # wait_for_ready blocks on the channel (no sleep loop) until the server is up.
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""),
                                  timeout=min(left, 5.0), wait_for_ready=True)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return svc
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    raise


def stop_service(svc: ServiceProc, timeout_s: float = 20.0) -> bool:
    """SIGTERM (graceful drain), then SIGKILL after `timeout_s`. True if it was running."""
    if not alive(svc.pid):
        return False
    os.kill(svc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(svc.pid) and time.monotonic() < deadline:
        try:
            os.waitpid(svc.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)  # polling another process's exit: no handle to wait on
    if alive(svc.pid):
        os.kill(svc.pid, signal.SIGKILL)
    return True


@dataclass(frozen=True)
class StackPorts:
    """Where the local stack listens (127.0.0.1). Engine replicas take consecutive ports from
    `engine`; the cheap cascade tier's engine the ones after them."""

    http: int = 8000
    gateway: int = 50051
    router: int = 50081
    engine: int = 50061
    kvcache: int = 50071
    draft: int = 50091


_NAME = re.compile(r"^[A-Za-z0-9._:/-]+$")  # what the router accepts as a tier name


@dataclass(frozen=True)
class StackPlan:
    """What `kvmesh up` starts: the KV-cache service, the draft service, `replicas` engines of
    `model` (one router tier named `served_name`), optionally a cheap tier (int4 weights) with a
    cascade route over both, the router and the gateway (tokenizing with `model`). Extra flags go
    to every process of one kind.

    Model: 'bundled', a .gguf file or an HF folder. Served name: `served_name`, else as vLLM the
    model as given ('bundled' is served as smollm2-135m-instruct). Drafts: the bundled model drafts
    for itself; any other model gets n-gram drafts unless `draft_model` names a draft model (same
    tokenizer)."""

    ports: StackPorts = StackPorts()
    replicas: int = 1
    cascade: bool = False
    engine_args: tuple[str, ...] = ()
    cheap_args: tuple[str, ...] = ("--weights", "int4")
    kvcache_args: tuple[str, ...] = ()
    draft_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    model: str = "bundled"
    served_name: str = ""
    """The name clients use; empty = derived from `model` (see the class docstring)."""
    draft_model: str = ""
    """Draft model for speculative decoding; empty = the bundled model for the bundled model, else none (n-gram)."""
    chat_template: str = ""
    """The gateway's --chat-template (a Jinja file or the template); empty = the model's."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not _NAME.match(self.name):
            raise ValueError(f"served model name {self.name!r} may hold only letters, digits and ._:/-; "
                             "pass --served-model-name NAME")

    @property
    def name(self) -> str:
        """The served model name (`served_name`, or derived from `model`)."""
        if self.served_name:
            return self.served_name
        return BUNDLED_NAME if self.model == "bundled" else self.model


def _threads_per_engine(engines: int) -> str:
    # NOTE: torch slows 10-50x when processes together run more OpenMP threads than there are
    # cores. One engine gets all cores; several split them; the other services run one thread.
    return str(max(1, (os.cpu_count() or 1) // engines))


@dataclass(frozen=True)
class ServiceSpec:
    """One process `up` starts: its name, module, flags (without --host/--port), port and env."""

    name: str
    module: str
    args: tuple[str, ...]
    port: int
    env: tuple[tuple[str, str], ...] = ()
    http_port: int | None = None


def stack_services(plan: StackPlan, data: Path) -> list[ServiceSpec]:
    """What `up` starts for `plan`, in start order (each after the ones it talks to)."""
    ports = plan.ports
    one_thread = (("OMP_NUM_THREADS", "1"),)
    threads = _threads_per_engine(plan.replicas + (1 if plan.cascade else 0))
    kv = f"127.0.0.1:{ports.kvcache}"
    specs = [ServiceSpec("kvcache", "kvmesh.services.kvcache",
                         ("--data-dir", str(data / "kvcache"), *plan.kvcache_args), ports.kvcache, one_thread)]
    # The draft service answers between the engine's steps (the engine waits for it): one thread.
    specs.append(ServiceSpec("draft", "kvmesh.services.draft", ("--threads", "1", *draft_flags(plan),
                                                                *plan.draft_args), ports.draft, one_thread))
    common = ("--model", plan.model, "--kvcache-address", kv, "--draft-address", f"127.0.0.1:{ports.draft}",
              "--threads", threads, "--served-name", plan.name)
    full = [ServiceSpec("engine" if plan.replicas == 1 else f"engine-{i}", "kvmesh.services.engine",
                        (*common, *plan.engine_args), ports.engine + i) for i in range(plan.replicas)]
    specs += full
    tiers = f"{plan.name}={','.join(f'127.0.0.1:{e.port}' for e in full)}@1.0"
    router_args: tuple[str, ...] = ("--tiers", tiers)
    if plan.cascade:
        cheap_port = ports.engine + plan.replicas
        specs.append(ServiceSpec("engine-cheap", "kvmesh.services.engine",
                                 (*common, *plan.cheap_args, *plan.engine_args), cheap_port))
        # the full model first: a request naming no model gets it
        router_args = ("--tiers", f"{tiers};cheap=127.0.0.1:{cheap_port}@0.6",
                       "--cascades", f"auto=cheap,{plan.name}", "--default-model", plan.name)
    specs.append(ServiceSpec("router", "kvmesh.services.router", (*router_args, *plan.router_args),
                             ports.router, one_thread))
    template = ("--chat-template", plan.chat_template) if plan.chat_template else ()
    specs.append(ServiceSpec("gateway", "kvmesh.services.gateway",
                             ("--model", plan.model, *template, "--router-address", f"127.0.0.1:{ports.router}",
                              "--http-port", str(ports.http), *plan.gateway_args),
                             ports.gateway, one_thread, http_port=ports.http))
    return specs


def draft_flags(plan: StackPlan) -> tuple[str, ...]:
    """The draft service's model flags for `plan`: the bundled model drafts for itself (the
    service's defaults); another model drafts with `plan.draft_model`, or n-gram only, for the
    served model's weights digest (read from its files: GetModelInfo's weights_digest)."""
    if plan.model == "bundled" and plan.draft_model in ("", "bundled"):
        return ()
    return ("--draft-model", plan.draft_model or "none", "--target-model", _source_digest(plan.model))


@functools.lru_cache(maxsize=4)
def _source_digest(source: str) -> str:
    from kvmesh.model.bundled import source_digest

    return source_digest(source)  # reads every weight byte: once per `up`


def check_model(plan: StackPlan) -> None:
    """Refuse a plan whose model or draft model cannot be served, before anything starts:
    LaunchError saying what to fix (missing files, a draft model with another tokenizer, an
    unreadable --chat-template)."""
    from kvmesh.model.bundled import source_tokenizer
    from kvmesh.model.tokenizer import read_chat_template

    try:
        tokenizer = source_tokenizer(plan.model)
        if plan.model != "bundled":
            _source_digest(plan.model)  # the weights are there (and their digest is ready)
        if plan.draft_model and plan.draft_model != "none":
            draft = source_tokenizer(plan.draft_model)
            if draft.fingerprint() != tokenizer.fingerprint():
                raise LaunchError(f"--draft-model {plan.draft_model} tokenizes differently from --model "
                                  f"{plan.model}; a draft model must share the served model's tokenizer")
        if plan.chat_template:
            read_chat_template(plan.chat_template)
    except (OSError, ValueError) as e:
        raise LaunchError(f"--model {plan.model}: {e}") from None


def up(plan: StackPlan = StackPlan(), ready_timeout_s: float = 900.0) -> list[ServiceProc]:
    """Starts the local stack unless it is already running — the KV-cache service (LMDB under the
    data directory), the draft service, the engines linked to both, the router over them and the gateway (OpenAI HTTP
    on 127.0.0.1:`ports.http`) — under a supervisor (kvmesh.supervisor) that waits for each to be
    healthy and from then on restarts any that exits. Returns them in start order."""
    running = [p for p in load_state() if alive(p.pid)]
    if running and supervisor_pid() is not None:
        return running
    for p in reversed(running):  # services left without their supervisor: start clean
        stop_service(p)
    check_model(plan)
    data = data_dir()
    plan_path = data / "stack-plan.json"
    write_json_atomic(plan_path, [asdict(s) for s in stack_services(plan, data)])
    _state_path().unlink(missing_ok=True)
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / "supervisor.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.supervisor", str(plan_path)],
                                stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    write_json_atomic(_supervisor_path(), {"pid": proc.pid, "log": str(log_path)})
    assert proc.stdout is not None
    # One line when every service is healthy or one failed to start (each start is bounded by the
    # supervisor's own timeout); EOF if the supervisor itself died.
    ready = select.select([proc.stdout], [], [], ready_timeout_s)[0]
    line = proc.stdout.readline().decode("utf-8", "replace").strip() if ready else ""
    proc.stdout.close()
    if line != "ready":
        if proc.poll() is None:
            proc.terminate()
        why = line.removeprefix("failed: ") if line else f"the supervisor gave no answer; see {log_path}"
        raise LaunchError(why)
    return load_state()


def openai_base_url() -> str | None:
    """The running local stack's OpenAI-compatible base URL (None when it is not running)."""
    for p in load_state():
        if p.url and alive(p.pid):
            return p.url
    return None


def down(timeout_s: float = 120.0) -> list[str]:
    """Stops the local stack: the supervisor (which stops its services, each drained, in reverse
    start order), then any service still running without it. Returns the names that were running."""
    procs = load_state()
    was = [p.name for p in procs if alive(p.pid)]
    sup = supervisor_pid()
    if sup is not None:
        stop_service(ServiceProc("supervisor", sup, "", ""), timeout_s=timeout_s)
    for p in reversed(procs):
        stop_service(p)
    _state_path().unlink(missing_ok=True)
    _supervisor_path().unlink(missing_ok=True)
    return list(reversed(was))
