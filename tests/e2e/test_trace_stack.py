"""One client request is one trace across every process: the whole stack as processes (what
`kvmesh up` starts), each exporting OTLP to a receiver in this test, one streaming chat request,
then the spans from all five services checked for one trace with the expected parent/child
structure and the right token counts and cache-hit attributes."""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvmesh import launcher

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SERVICES = {"kvmesh-gateway", "kvmesh-router", "kvmesh-engine", "kvmesh-kvcache", "kvmesh-draft"}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: keeps every span with its service name; `wait(pred)` blocks until
    the spans received satisfy `pred` (woken by each export, no polling)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.cond = threading.Condition()

    def Export(self, request, context):
        with self.cond:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "kind": s.kind,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "events": [e.name for e in s.events]})
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait(self, pred, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.spans), timeout)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@contextlib.contextmanager
def traced_up(data_dir, **plan) -> Iterator[tuple[dict, Receiver]]:
    """`kvmesh up` (StackPlan(**plan), free ports, state in `data_dir`) with every process
    exporting its spans to a Receiver in this test; yields ({name: ServiceProc}, receiver)."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_DATA_DIR", str(data_dir))
    mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"127.0.0.1:{port}")
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export batches every 100 ms
    ports = launcher.StackPorts(http=launcher.free_port(), gateway=launcher.free_port(),
                                router=launcher.free_port(), engine=launcher.free_port(),
                                kvcache=launcher.free_port(), draft=launcher.free_port())
    try:
        procs = launcher.up(launcher.StackPlan(ports=ports, **plan))
        yield {p.name: p for p in procs}, receiver
    finally:
        launcher.down()
        mp.undo()
        server.stop(None)


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory):
    # --spec-local-ngram false: the adaptive gate's n-gram arms call the draft service, so a short
    # answer that drafts at all crosses the Propose hop (by default they look drafts up in the
    # engine, and a 12-token answer can finish on them before the gate tries the service's arm)
    with traced_up(tmp_path_factory.mktemp("stack"),
                   engine_args=("--kv-cache-bytes", str(64 << 20), "--kv-chunk-tokens", "64",
                                "--spec-local-ngram", "false")) as stack:
        yield stack


def _chat(stack, trace_id: str, parent: str, text: str):
    client = openai.OpenAI(base_url=stack["gateway"].url, api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    return [c for c in stream][-1].usage


def test_one_request_is_one_trace_across_all_five_services(traced_stack):
    stack, receiver = traced_stack
    text = "Repeat after me, word for word: " + "the quick brown fox jumps over the lazy dog. " * 12
    first_trace, second_trace, caller = "1" * 32, "2" * 32, "a" * 16
    usage = _chat(stack, first_trace, caller, text)

    def complete(trace_id: str, puts: bool):
        def pred(spans):
            mine = [s for s in spans if s["trace"] == trace_id]
            names = {(s["service"], s["name"]) for s in mine}
            ids = {s["id"] for s in mine}
            # services export in their own batches: a server span (a second chunk's Put) can
            # arrive before its caller's client span, so wait until the tree is connected
            connected = all(s["parent"] == caller or s["parent"] in ids for s in mine)
            return (connected and {s["service"] for s in mine} >= SERVICES
                    and ("kvmesh-gateway", "POST /v1/chat/completions") in names
                    and ("kvmesh-engine", "engine.decode") in names
                    and ("kvmesh-router", "/kvmesh.router.v1.RouterService/Generate") in names
                    and ("kvmesh-engine", "/kvmesh.engine.v1.EngineService/Generate") in names
                    and (not puts or ("kvmesh-kvcache", "/kvmesh.kvcache.v1.KvcacheService/Put") in names))
        return pred

    assert receiver.wait(complete(first_trace, puts=True), 60), (
        f"spans of the trace came from {sorted({s['service'] for s in receiver.spans if s['trace'] == first_trace})}")
    spans = [s for s in receiver.spans if s["trace"] == first_trace]
    by_id = {s["id"]: s for s in spans}
    children = defaultdict(list)
    for s in spans:
        children[s["parent"]].append(s)

    def one(service: str, name: str, parent: dict | None = None) -> dict:
        found = [s for s in spans if s["service"] == service and s["name"] == name
                 and (parent is None or s["parent"] == parent["id"])]
        assert found, f"no {name} span from {service}" + (f" under {parent['name']}" if parent else "")
        return found[0]

    # gateway HTTP server span, parented by the client's traceparent
    http = one("kvmesh-gateway", "POST /v1/chat/completions")
    assert http["parent"] == caller
    route_call = one("kvmesh-gateway", "/kvmesh.router.v1.RouterService/Generate", http)
    route = one("kvmesh-router", "/kvmesh.router.v1.RouterService/Generate", route_call)
    assert route["attrs"]["kvmesh.route.tier"] and route["attrs"]["kvmesh.route.policy"] == "kv_aware"
    engine_call = one("kvmesh-router", "/kvmesh.engine.v1.EngineService/Generate", route)
    engine = one("kvmesh-engine", "/kvmesh.engine.v1.EngineService/Generate", engine_call)
    for stage in ("engine.queue", "engine.prefill", "engine.decode", "engine.kv_fetch"):
        one("kvmesh-engine", stage, engine)
    fetch = one("kvmesh-engine", "engine.kv_fetch", engine)
    lookup_call = one("kvmesh-engine", "/kvmesh.kvcache.v1.KvcacheService/Lookup", fetch)
    lookup = one("kvmesh-kvcache", "/kvmesh.kvcache.v1.KvcacheService/Lookup", lookup_call)
    assert lookup["attrs"]["kvmesh.kv.hit_chunks"] == 0  # a cold prompt
    propose_call = one("kvmesh-engine", "/kvmesh.draft.v1.DraftService/Propose", engine)
    one("kvmesh-draft", "/kvmesh.draft.v1.DraftService/Propose", propose_call)
    put_call = one("kvmesh-engine", "/kvmesh.kvcache.v1.KvcacheService/Put", engine)
    put = one("kvmesh-kvcache", "/kvmesh.kvcache.v1.KvcacheService/Put", put_call)
    assert put["attrs"]["kvmesh.kv.tokens"] == 64 and put["attrs"]["kvmesh.kv.bytes"] > 0
    # every span hangs off the client's span: one connected tree
    for s in spans:
        assert s["parent"] == caller or s["parent"] in by_id, f"{s['service']} {s['name']} is detached"

    # token counts where the issue asks for them
    assert http["attrs"]["gen_ai.request.model"] == MODEL
    assert http["attrs"]["gen_ai.provider.name"] == engine["attrs"]["gen_ai.provider.name"] == "kvmesh"
    assert "gen_ai.system" not in http["attrs"] and "gen_ai.system" not in engine["attrs"]
    assert http["attrs"]["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert http["attrs"]["gen_ai.usage.output_tokens"] == usage.completion_tokens > 0
    assert engine["attrs"]["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert engine["attrs"]["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert engine["attrs"]["gen_ai.usage.cache_read.input_tokens"] == 0

    # the same prompt again: a cache hit, and the trace says so
    again = _chat(stack, second_trace, caller, text)
    assert again.prompt_tokens_details.cached_tokens > 0
    assert receiver.wait(complete(second_trace, puts=False), 60)
    spans = [s for s in receiver.spans if s["trace"] == second_trace]
    [engine2] = [s for s in spans if s["service"] == "kvmesh-engine" and s["name"].endswith("EngineService/Generate")]
    assert engine2["attrs"]["gen_ai.usage.cache_read.input_tokens"] == again.prompt_tokens_details.cached_tokens
    [http2] = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    assert http2["attrs"]["gen_ai.usage.cache_read.input_tokens"] == again.prompt_tokens_details.cached_tokens
    lookups = [s for s in spans if s["service"] == "kvmesh-kvcache" and s["name"].endswith("/Lookup")]
    assert lookups  # the engine still asks the KV service, for the chunks its own cache lacks
