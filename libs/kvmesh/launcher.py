"""Runs the kvmesh topology as local processes: start with readiness waits, stop, status.

State (pids with their start times and command lines, ports, log paths) lives in
`<data dir>/stack.json`, the supervisor's in `<data dir>/supervisor.json`; each service logs to
`<data dir>/logs/<service>.log`. The data directory is $KVMESH_DATA_DIR or ~/.kvmesh. A recorded
pid is signalled only while it is still the recorded process (kvmesh.procid): after pid reuse
the entry is stale, and `status` and `down` say so and leave the process alone.
"""
from __future__ import annotations

import functools
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.model.bundled import BUNDLED_NAME
from kvmesh import procid
from kvmesh.procid import Check, Liveness, ProcessIdentity
from kvmesh.threads import usable_cores


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
    start_ticks: int | None = None
    """Its start time (kvmesh.procid); None in state written by an older kvmesh."""
    cmdline: tuple[str, ...] = ()
    """Its command line as started; empty in state written by an older kvmesh."""
    metrics: str = ""
    """Where its Prometheus metrics are scraped (http://HOST:PORT/metrics), or '' if it exports none."""

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_ticks, tuple(self.cmdline))

    def check(self) -> Check:
        """Whether this service still runs under its pid (RUNNING), exited, or the entry is STALE."""
        return procid.check(self.identity, self.looks_like)

    def looks_like(self, cmdline: tuple[str, ...]) -> bool:
        """For an entry without a start time: `python -m kvmesh.services.* ... --port <its port>`."""
        port = self.address.rpartition(":")[2]
        return _runs_module(cmdline, "kvmesh.services.") and _flag(cmdline, "--port") == port


class LaunchError(RuntimeError):
    """A service did not come up; the message says which and where its log is."""


def _state_path() -> Path:
    return data_dir() / "stack.json"


def load_state() -> list[ServiceProc]:
    try:
        entries = json.loads(_state_path().read_text())
    except FileNotFoundError:
        return []
    return [ServiceProc(**{**p, "cmdline": tuple(p.get("cmdline", ()))}) for p in entries]


def _runs_module(cmdline: tuple[str, ...], prefix: str) -> bool:
    """`cmdline` is `<python> -m <module starting with prefix> ...`."""
    return len(cmdline) >= 3 and cmdline[1] == "-m" and cmdline[2].startswith(prefix)


def _flag(cmdline: tuple[str, ...], name: str) -> str | None:
    i = cmdline.index(name) if name in cmdline else -1
    return cmdline[i + 1] if 0 <= i < len(cmdline) - 1 else None


def write_json_atomic(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    tmp.replace(path)


def _supervisor_path() -> Path:
    return data_dir() / "supervisor.json"


def supervisor_identity() -> ProcessIdentity | None:
    """The stack's supervisor as recorded by `up` (None without a record)."""
    try:
        rec = json.loads(_supervisor_path().read_text())
        return ProcessIdentity(int(rec["pid"]), rec.get("start_ticks"), tuple(rec.get("cmdline", ())))
    except (FileNotFoundError, ValueError, KeyError):
        return None


def supervisor_check() -> Check:
    """Whether the recorded supervisor runs (EXITED when there is no record)."""
    rec = supervisor_identity()
    return Check(Liveness.EXITED) if rec is None else procid.check(rec, _is_supervisor)


def supervisor_pid() -> int | None:
    """The running stack's supervisor process, or None (also when its record is stale)."""
    rec = supervisor_identity()
    return rec.pid if rec is not None and supervisor_check().state is Liveness.RUNNING else None


def _is_supervisor(cmdline: tuple[str, ...]) -> bool:
    return _runs_module(cmdline, "kvmesh.supervisor")


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on `host` (for tests and benchmarks that start services)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether any process has `pid`: for a process this one holds a handle to (a test's
    `start_service`); a pid read from a file is checked with `ServiceProc.check`."""
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
    argv = [sys.executable, "-m", module, "--host", host, "--port", str(port), *args]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    address = f"{host}:{port}"
    started = ProcessIdentity.started(proc.pid, argv)
    svc = ServiceProc(name, proc.pid, address, str(log_path), start_ticks=started.start_ticks,
                      cmdline=started.cmdline)
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


def stop_service(svc: ServiceProc, timeout_s: float = 20.0) -> Check:
    """SIGTERM (graceful drain), then SIGKILL after `timeout_s`, and wait for the exit — only if
    `svc` still runs under its pid. Returns what was found (RUNNING: it was running and is
    stopped; STALE: another process has the pid and was left alone)."""
    return procid.terminate(svc.identity, svc.looks_like, timeout_s)


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
    metrics: int = 0
    """Prometheus /metrics of every service but the gateway (which serves /metrics on `http`): 0
    gives each a free port, chosen at `up` and listed by `kvmesh status`; N gives them N, N+1, ...
    in start order; -1 turns them off."""


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
    pd: tuple[int, int] | None = None
    """P/D disaggregation: (P, D) prefill and decode engines (--role) instead of `replicas`, one
    router tier with both kinds (see the router's NOTE on P/D)."""
    pin_engines: bool = False
    """Pin each engine to its own cores (--cpus): the usable CPUs split in order, engine i the
    i-th share (at least one CPU each, wrapping round when there are more engines than CPUs)."""
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
    return str(max(1, usable_cores() // engines))


@dataclass(frozen=True)
class ServiceSpec:
    """One process `up` starts: its name, module, flags (without --host/--port), port and env."""

    name: str
    module: str
    args: tuple[str, ...]
    port: int
    env: tuple[tuple[str, str], ...] = ()
    http_port: int | None = None
    metrics_port: int | None = None
    """Its Prometheus /metrics port (passed as --metrics-port), None when it exports none there."""


def stack_services(plan: StackPlan, data: Path) -> list[ServiceSpec]:
    """What `up` starts for `plan`, in start order (each after the ones it talks to)."""
    ports = plan.ports
    one_thread = (("OMP_NUM_THREADS", "1"),)
    engines = sum(plan.pd) if plan.pd else plan.replicas
    threads = _threads_per_engine(engines + (1 if plan.cascade else 0))
    kv = f"127.0.0.1:{ports.kvcache}"
    specs = [ServiceSpec("kvcache", "kvmesh.services.kvcache",
                         ("--data-dir", str(data / "kvcache"), *plan.kvcache_args), ports.kvcache, one_thread)]
    # The draft service answers between the engine's steps (the engine waits for it): one thread.
    # It drafts for the engines' model, and its metrics carry that model's name.
    specs.append(ServiceSpec("draft", "kvmesh.services.draft",
                             ("--threads", "1", *draft_flags(plan), "--served-model-name", plan.name,
                              *plan.draft_args), ports.draft, one_thread))
    common = ("--model", plan.model, "--kvcache-address", kv, "--draft-address", f"127.0.0.1:{ports.draft}",
              "--threads", threads, "--served-model-name", plan.name)
    if plan.pd:
        roles = ["prefill"] * plan.pd[0] + ["decode"] * plan.pd[1]
        full = [ServiceSpec(f"engine-{role}-{i}", "kvmesh.services.engine",
                            (*common, "--role", role, *plan.engine_args), ports.engine + i)
                for i, role in enumerate(roles)]
        replicas = [f"127.0.0.1:{e.port}/{role}" for e, role in zip(full, roles)]
    else:
        full = [ServiceSpec("engine" if plan.replicas == 1 else f"engine-{i}", "kvmesh.services.engine",
                            (*common, *plan.engine_args), ports.engine + i) for i in range(plan.replicas)]
        replicas = [f"127.0.0.1:{e.port}" for e in full]
    if plan.pin_engines:
        full = _pinned(full)
    specs += full
    tiers = f"{plan.name}={','.join(replicas)}@1.0"
    router_args: tuple[str, ...] = ("--tiers", tiers)
    if plan.cascade:
        cheap_port = ports.engine + len(full)
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
                              "--kvcache-address", kv,
                              "--http-port", str(ports.http), *plan.gateway_args),
                             ports.gateway, one_thread, http_port=ports.http))
    return _with_metrics(specs, ports.metrics)


def _pinned(engines: list[ServiceSpec]) -> list[ServiceSpec]:
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // len(engines))
    out = []
    for i, spec in enumerate(engines):
        mine = [cpus[(i * share + j) % len(cpus)] for j in range(share)]
        args = [a for a in spec.args]
        args[args.index("--threads") + 1] = str(len(mine))
        out.append(replace(spec, args=(*args, "--cpus", ",".join(map(str, mine)))))
    return out


def _with_metrics(specs: list[ServiceSpec], base: int) -> list[ServiceSpec]:
    """Every spec but the gateway's (its /metrics is on its HTTP port) with a --metrics-port:
    consecutive from `base`, free ports when `base` is 0, none when it is -1."""
    if base < 0:
        return specs
    out, i = [], 0
    for s in specs:
        if s.http_port is None:
            port = base + i if base else free_port()
            i += 1
            s = replace(s, args=(*s.args, "--metrics-port", str(port)), metrics_port=port)
        out.append(s)
    return out


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


def convert_models(plan: StackPlan, progress: Callable[[str], None] = lambda line: None) -> list[str]:
    """Convert the stack's GGUF models (served and draft) into the weights cache in this process,
    the conversion's progress bar on this process's stderr, when the cache does not hold them yet
    (the first `up`). The engines and the draft service then find them converted, instead of each
    converting in its own process with the bar in its log. Returns the sources it converted."""
    from kvmesh.model.gguf_loader import conversion_folder, ensure_converted
    from kvmesh.model.loader import gguf_source

    converted = []
    for source in dict.fromkeys(s for s in (plan.model, plan.draft_model) if s and s != "none"):
        path = gguf_source(source)
        if path is None:  # an HF folder: served as it is
            continue
        digest = _source_digest(source)
        if conversion_folder(digest).is_dir():
            continue
        progress(f"{'model':12s} converting {path.name} into the weights cache (first start only)")
        begun = time.monotonic()
        ensure_converted(path, digest=digest, progress=True)
        progress(f"{'model':12s} converted in {time.monotonic() - begun:.1f}s")
        converted.append(source)
    return converted


def up(plan: StackPlan = StackPlan(), ready_timeout_s: float = 900.0,
       progress: Callable[[str], None] = lambda line: None) -> list[ServiceProc]:
    """Starts the local stack unless it is already running — the KV-cache service (LMDB under the
    data directory), the draft service, the engines linked to both, the router over them and the gateway (OpenAI HTTP
    on 127.0.0.1:`ports.http`) — under a supervisor (kvmesh.supervisor) that waits for each to be
    healthy and from then on restarts any that exits. `progress` gets one line per service as it
    becomes healthy. Returns them in start order; LaunchError with the failing service's own last
    log lines when one does not start. A GGUF model the weights cache lacks is converted first, in
    this process (`convert_models`: its progress bar on this terminal)."""
    running = [p for p in load_state() if p.check().state is Liveness.RUNNING]
    if running and supervisor_pid() is not None:
        return running
    for p in reversed(running):  # services left without their supervisor: start clean
        stop_service(p)
    check_model(plan)
    try:
        convert_models(plan, progress)
    except (OSError, ValueError) as e:
        raise LaunchError(f"--model {plan.model}: converting its weights failed: {e}") from None
    data = data_dir()
    plan_path = data / "stack-plan.json"
    write_json_atomic(plan_path, [asdict(s) for s in stack_services(plan, data)])
    _state_path().unlink(missing_ok=True)
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / "supervisor.log"
    argv = [sys.executable, "-m", "kvmesh.supervisor", str(plan_path)]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    started = ProcessIdentity.started(proc.pid, argv)
    write_json_atomic(_supervisor_path(), {"pid": proc.pid, "start_ticks": started.start_ticks,
                                           "cmdline": argv, "log": str(log_path)})
    assert proc.stdout is not None
    # The supervisor's answer (its module docstring): a line per healthy service, then "ready" or
    # the failing service's log lines and "failed: ..." (each start is bounded by the
    # supervisor's own timeout); EOF if the supervisor itself died.
    deadline = time.monotonic() + ready_timeout_s
    line, tail = "", []
    while True:
        ready = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
        line = proc.stdout.readline().decode("utf-8", "replace").rstrip("\n") if ready else ""
        if line.startswith("healthy "):
            name, address, seconds = (line.split() + ["", "", ""])[1:4]
            progress(f"{name:12s} healthy on {address} after {seconds}s")
        elif line.startswith("log "):
            tail.append(line[4:])
        else:
            break
    proc.stdout.close()
    if line != "ready":
        if proc.poll() is None:
            proc.terminate()
        why = line.removeprefix("failed: ") if line else f"the supervisor gave no answer; see {log_path}"
        if tail:
            why += "\nits last lines:\n" + "\n".join(f"  {t}" for t in tail)
        raise LaunchError(why)
    return load_state()


def openai_base_url() -> str | None:
    """The running local stack's OpenAI-compatible base URL (None when it is not running)."""
    for p in load_state():
        if p.url and p.check().state is Liveness.RUNNING:
            return p.url
    return None


def down(timeout_s: float = 120.0) -> dict[str, Check]:
    """Stops the local stack: the supervisor (which stops its services, each drained, in reverse
    start order), then any service still running without it; a stale entry (its pid now another
    process's) is left alone. Returns what each entry was found to be, services in reverse start
    order, then 'supervisor' if it had a record."""
    procs = load_state()
    found = {p.name: p.check() for p in reversed(procs)}  # before the supervisor stops them
    sup = supervisor_identity()
    sup_found = procid.terminate(sup, _is_supervisor, timeout_s) if sup is not None else None
    for p in reversed(procs):
        stop_service(p)
    _state_path().unlink(missing_ok=True)
    _supervisor_path().unlink(missing_ok=True)
    return found | ({"supervisor": sup_found} if sup_found is not None else {})
