"""P/D as `kvmesh up --pd 1:1` starts it (processes): a long prompt is prefilled on the prefill
engine and decoded on the decode engine, the answer equals the colocated one (the same prompt ids
run whole on one engine), and its one trace shows the prefill hop, the transfer and the decode hop
on their own services."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from test_trace_stack import traced_up

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory):
    with traced_up(tmp_path_factory.mktemp("pd-stack"), pd=(1, 1),
                   engine_args=("--kv-cache-bytes", str(64 << 20), "--kv-chunk-tokens", "64", "--speculation", "off"),
                   router_args=("--pd-min-prompt-tokens", "128")) as stack:
        yield stack


def _answer(stack, text: str, trace_id: str | None = None, max_tokens: int = 12):
    client = openai.OpenAI(base_url=stack["gateway"].url, api_key="unused", max_retries=0, timeout=120)
    headers = {"traceparent": f"00-{trace_id}-{'a' * 16}-01"} if trace_id else {}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                         max_tokens=max_tokens, temperature=0, extra_headers=headers)
    return out.choices[0].message.content, out.usage


def _counter(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_a_long_prompt_is_disaggregated_with_the_colocated_answer_and_one_trace(pd_stack):
    stack, receiver = pd_stack
    text = "Summarise this in one sentence: " + "the river runs north past the old stone mill. " * 25
    trace_id = "3" * 32
    disaggregated, usage = _answer(stack, text, trace_id)
    assert usage.prompt_tokens > 128 and usage.prompt_tokens_details.cached_tokens > 0  # imported KV
    router_metrics = stack["router"].metrics
    assert _counter(router_metrics, "kvmesh_router_pd_routes_total", route="pd") == 1
    prefill_metrics = stack["engine-prefill-0"].metrics
    assert _counter(prefill_metrics, "kvmesh_engine_pd_handoffs_total", outcome="ok") == 1
    assert _counter(prefill_metrics, "kvmesh_engine_pd_handoff_bytes_total") > 0

    def complete(spans):
        mine = [s for s in spans if s["trace"] == trace_id]
        engines = [s for s in mine if s["name"] == "/kvmesh.engine.v1.EngineService/Generate"
                   and s["service"] == "kvmesh-engine"]
        puts = [s for s in mine if s["name"] == "/kvmesh.kvcache.v1.KvcacheService/Put" and s["service"] == "kvmesh-kvcache"]
        gets = [s for s in mine if s["name"] == "/kvmesh.kvcache.v1.KvcacheService/Get" and s["service"] == "kvmesh-kvcache"]
        ids = {s["id"] for s in mine}
        # services export in their own batches: wait until the tree is connected
        connected = all(s["parent"] == "a" * 16 or s["parent"] in ids for s in mine)
        return connected and len(engines) == 2 and puts and gets
    if not receiver.wait(complete, 60):
        mine = [s for s in receiver.spans if s["trace"] == trace_id]
        ids = {s["id"] for s in mine}
        raise AssertionError("the trace is incomplete; spans whose parent never came: " + ", ".join(
            f"{s['service']} {s['name']}" for s in mine if s["parent"] not in ids and s["parent"] != "a" * 16))
    spans = [s for s in receiver.spans if s["trace"] == trace_id]
    by_id = {s["id"]: s for s in spans}
    route = next(s for s in spans if s["service"] == "kvmesh-router" and s["name"].endswith("RouterService/Generate"))
    assert route["attrs"]["kvmesh.route.policy"] == "pd" and "kvmesh.pd.handoff" in route["events"]
    hops = [s for s in spans if s["service"] == "kvmesh-engine" and s["name"].endswith("EngineService/Generate")]
    prefill = next(s for s in hops if s["attrs"].get("kvmesh.pd.role") == "prefill")
    decode = next(s for s in hops if s is not prefill)
    for hop in (prefill, decode):  # both engine calls hang off the router's span
        assert by_id[hop["parent"]]["parent"] == route["id"]
    assert prefill["attrs"]["kvmesh.pd.handoff_ok"] and prefill["attrs"]["kvmesh.pd.handoff_tokens"] > 128 - 64
    assert decode["attrs"]["kvmesh.resumed_tokens"] == 1
    assert decode["attrs"]["gen_ai.usage.cache_read.input_tokens"] == usage.prompt_tokens_details.cached_tokens

    def under(span, name):  # a descendant named `name`
        ids = {span["id"]}
        for _ in range(6):
            ids |= {s["id"] for s in spans if s["parent"] in ids}
        return [s for s in spans if s["id"] in ids and s["name"].endswith(name)]
    assert under(prefill, "KvcacheService/Put") and under(decode, "KvcacheService/Get")

    # the colocated answer: the same prompt ids (the gateway's /tokenize, chat template applied)
    # run whole on one engine, as the route's colocated fallback would run them
    root = stack["gateway"].url.removesuffix("/v1")
    ids = httpx.post(f"{root}/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                "add_generation_prompt": True}, timeout=30).json()["tokens"]
    assert len(ids) == usage.prompt_tokens
    with grpc.insecure_channel(stack["engine-decode-1"].address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        req = engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids),
                                         sampling=engine_pb2.SamplingParams(max_tokens=12))
        colocated = "".join(m.delta.text for m in stub.Generate(req, timeout=120))
    assert colocated == disaggregated
