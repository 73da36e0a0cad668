"""Lossy reuse by contract at the gateway: a request (the `kvmesh.lossy` extension or the gRPC
GenerationOptions.lossy) or its tenant (the keys file's "lossy" object) opts into a lossy path
with a quality budget; nothing else does. What reaches the engine, how bad input is refused, and
how a fallback is reported."""
from __future__ import annotations

import json

import pytest

from kvmesh.engine.v1 import engine_pb2
from kvmesh.gateway.v1 import gateway_pb2 as pb
from kvmesh.kv.quality import LossyOptIn, QualityBudget
from kvmesh.services.gateway import grpc_servicer
from kvmesh.services.gateway.auth import KeysFileError, KeyStore, Tenant, parse_keys_file
from kvmesh.services.gateway.errors import ApiError
from kvmesh.services.gateway.keys import add_key, main
from kvmesh.services.gateway.openai_format import kvmesh_body
from kvmesh.services.gateway.openai_schema import chat_request, completion_request, parse_body
from kvmesh.services.gateway.spec import (
    DocumentRef,
    KvReuse,
    Limits,
    Sampling,
    Usage,
    validate_request,
)
from .test_documents import CONVERSATION, _gateway  # the same tiny gateway

SHARED_PLAIN = Tenant("plain", "ns:shared")
SHARED_LOSSY = Tenant("lossy", "ns:shared", lossy=LossyOptIn("int8", 0.2, QualityBudget(0.1, None)))


async def _upstream(tenant: Tenant, **kw) -> engine_pb2.GenerateRequest:
    from kvmesh.services.gateway.spec import GenerationRequest

    gw = _gateway(max_model_len=4096)
    base = dict(kind="chat", model="m", messages=CONVERSATION, sampling=Sampling(max_tokens=4))
    gen = await gw.start(GenerationRequest(**{**base, **kw}), tenant, endpoint="t", arrival=0.0)
    request = gen.upstream_requests[0].request
    await gen.aclose()
    return request


async def test_nothing_lossy_reaches_the_engine_without_an_opt_in():
    g = await _upstream(SHARED_PLAIN, documents=(DocumentRef(text="Doc."),))
    assert not g.HasField("kv_storage") and not g.HasField("blend") and not g.HasField("quality_budget")


async def test_a_tenant_opt_in_applies_to_its_requests_only_even_in_a_shared_namespace():
    lossy = await _upstream(SHARED_LOSSY, documents=(DocumentRef(text="Doc."),))
    plain = await _upstream(SHARED_PLAIN, documents=(DocumentRef(text="Doc."),))
    assert lossy.cache_salt == plain.cache_salt == "ns:shared"
    assert lossy.kv_storage.codec == engine_pb2.KV_CODEC_INT8
    assert lossy.blend.recompute_ratio == pytest.approx(0.2)
    assert lossy.quality_budget.max_kl == pytest.approx(0.1) and lossy.quality_budget.min_top1 == 0.0
    assert not plain.HasField("kv_storage") and not plain.HasField("blend")
    no_docs = await _upstream(SHARED_LOSSY)  # blending needs documents: only the codec applies
    assert no_docs.kv_storage.codec == engine_pb2.KV_CODEC_INT8 and not no_docs.HasField("blend")


async def test_a_request_opt_in_overrides_its_tenant_field_by_field():
    request = LossyOptIn("int4", None, QualityBudget(None, 0.99))
    g = await _upstream(SHARED_LOSSY, documents=(DocumentRef(text="Doc."),), lossy=request)
    assert g.kv_storage.codec == engine_pb2.KV_CODEC_INT4
    assert g.blend.recompute_ratio == pytest.approx(0.2)  # the tenant's
    assert g.quality_budget.max_kl == pytest.approx(0.1) and g.quality_budget.min_top1 == pytest.approx(0.99)
    top = await _upstream(SHARED_PLAIN, documents=(DocumentRef(text="Doc."),), recompute_ratio=0.3,
                          lossy=LossyOptIn(None, 0.1))
    assert top.blend.recompute_ratio == pytest.approx(0.3)  # the documented top-level field wins


def test_the_http_extension_parses_for_chat_and_completions():
    chat = chat_request(parse_body(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "q"}], "documents": [{"id": "a"}],
        "kvmesh": {"lossy": {"kv_codec": "int8", "recompute_ratio": 0.15, "max_kl": 0.02, "min_top1": 0.97}},
    }).encode(), "chat"))
    assert chat.lossy == LossyOptIn("int8", 0.15, QualityBudget(0.02, 0.97))
    completion = completion_request(parse_body(json.dumps({
        "model": "m", "prompt": "p", "kvmesh": {"lossy": {"kv_codec": "fp16"}}}).encode(), "completion"))
    assert completion.lossy == LossyOptIn("fp16")
    assert completion_request(parse_body(b'{"model": "m", "prompt": "p"}', "completion")).lossy is None


@pytest.mark.parametrize("ext, param, says", [
    ({"lossy": {"kv_codec": "int3"}}, "kvmesh.lossy", "not a lossy KV codec"),
    ({"lossy": {"kv_codec": "fp32"}}, "kvmesh.lossy", "exact reuse needs no opt-in"),
    ({"lossy": {"recompute_ratio": 1.0}}, "kvmesh.lossy", "[0, 1)"),
    ({"lossy": {"max_kl": -1}}, "kvmesh.lossy", "max_kl must be a positive"),
    ({"lossy": {"min_top1": 2}}, "kvmesh.lossy", "min_top1 must be in (0, 1]"),
    ({"lossy": {"max_kl": "0.1"}}, "kvmesh.lossy", "must be a number"),
    ({"lossy": {"codec": "int8"}}, "kvmesh.lossy", "unknown field 'codec'"),
    ({"lossy": "int8"}, "kvmesh.lossy", "must be an object"),
    ({"blend": {}}, "kvmesh.blend", "not a kvmesh extension"),
    ("lossy", "kvmesh", "must be an object"),
])
def test_a_bad_extension_is_a_400_naming_the_field(ext, param, says):
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}], "kvmesh": ext}).encode()
    with pytest.raises(ApiError) as e:
        validate_request(chat_request(parse_body(raw, "chat")), Limits())
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert says in e.value.message


def test_blending_without_documents_is_refused():
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}],
                      "kvmesh": {"lossy": {"recompute_ratio": 0.2}}}).encode()
    with pytest.raises(ApiError) as e:
        validate_request(chat_request(parse_body(raw, "chat")), Limits())
    assert e.value.param == "kvmesh.lossy.recompute_ratio" and "needs documents" in e.value.message


def test_the_grpc_options_carry_the_same_opt_in():
    options = pb.GenerationOptions(lossy=pb.LossyReuse(kv_codec="int8", budget={"max_kl": 0.03}))
    req = grpc_servicer.complete_request(pb.CompleteRequest(model="m", text="p", options=options))
    assert req.lossy == LossyOptIn("int8", None, QualityBudget(0.03, None))
    with pytest.raises(ApiError) as e:
        grpc_servicer.complete_request(pb.CompleteRequest(
            model="m", text="p", options=pb.GenerationOptions(lossy=pb.LossyReuse(kv_codec="nope"))))
    assert e.value.param == "options.lossy"


def test_the_keys_file_holds_a_tenant_opt_in(tmp_path, capsys):
    path = tmp_path / "keys.json"
    _, key = add_key(path, "acme", lossy=LossyOptIn("int8", None, QualityBudget(0.05, 0.98)))
    tenant = KeyStore(path).authenticate(key)
    assert tenant.lossy == LossyOptIn("int8", None, QualityBudget(0.05, 0.98))
    assert main(["add", "--keys-file", str(path), "--tenant", "beta", "--lossy", '{"recompute_ratio": 0.25}']) == 0
    beta = KeyStore(path).authenticate(capsys.readouterr().out.strip())
    assert beta.lossy == LossyOptIn(None, 0.25)
    assert main(["add", "--keys-file", str(path), "--tenant", "gamma", "--lossy", '{"kv_codec": "zip"}']) == 2
    assert "--lossy" in capsys.readouterr().err
    data = json.loads(path.read_text())
    data["tenants"][0]["lossy"] = {"kv_codec": "int8", "max_kl": 0}
    with pytest.raises(KeysFileError, match=r"tenants\[0\]\.lossy: max_kl"):
        parse_keys_file(data, "keys.json")


def test_a_fallback_is_reported_even_without_a_cache_hit():
    usage = Usage(prompt_tokens=10)
    usage.add_choice(0, 3, 0, KvReuse("exact", 0, "int8c-g16-r0-h1-o0: disabled by the guardrail"))
    body = kvmesh_body(usage)
    assert body["reuse"]["exact"] and "disabled by the guardrail" in body["reuse"]["fallback"]
    plain = Usage(prompt_tokens=10)
    plain.add_choice(0, 3, 0)
    assert kvmesh_body(plain) is None
