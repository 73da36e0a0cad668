"""Gateway.start: defaults, the mapping to engine SamplingParams, context checks, admission."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gateway_utils import tiny_tokenizer
from kvmesh.services.gateway.admission import Admission, AdmissionLimits
from kvmesh.services.gateway.auth import KeyStore, Tenant
from kvmesh.services.gateway.errors import ApiError
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.gateway.prompts import PromptBuilder
from kvmesh.services.gateway.service import Gateway, GatewayOptions
from kvmesh.services.gateway.spec import ChatTurn, GenerationRequest, Sampling
from kvmesh.services.gateway.upstream import ModelEntry

TENANT = Tenant("acme", "tenant:acme")


class _Catalog:
    def __init__(self, max_model_len: int) -> None:
        self.entry = ModelEntry("m", "root", max_model_len, 0)

    async def get(self, model_id: str) -> ModelEntry:
        return self.entry


def _gateway(max_model_len: int = 64, **limits) -> Gateway:
    admission = Admission(AdmissionLimits(**{"max_requests": 8, "max_prompt_tokens": 1000, **limits}))
    return Gateway(None, _Catalog(max_model_len), PromptBuilder(tiny_tokenizer()),  # type: ignore[arg-type]
                   KeyStore(None), admission, GatewayOptions(default_temperature=0.7),
                   GatewayMetrics(CollectorRegistry()))


async def _start(gw: Gateway, **kw):
    base = dict(kind="completion", model="m", prompts=("hello",), sampling=Sampling())
    return await gw.start(GenerationRequest(**{**base, **kw}), TENANT, endpoint="t", arrival=0.0)


async def test_defaults_and_tenant_fields():
    gen = await _start(_gateway())
    [r] = gen.upstream_requests
    sp = r.request.sampling
    assert sp.max_tokens == 16 and sp.temperature == pytest.approx(0.7)
    assert not sp.HasField("seed") and not sp.HasField("top_p") and not sp.HasField("logprobs")
    assert (r.tenant, r.request.cache_salt, r.model, r.prompt_text) == ("acme", "tenant:acme", "m", "hello")
    assert list(r.request.token_ids.ids) == list(b"hello")
    assert r.request.request_id == f"{gen.id}-0" and gen.usage.prompt_tokens == 5
    await gen.aclose()


async def test_chat_defaults_to_the_rest_of_the_context():
    gw = _gateway(max_model_len=64)
    gen = await _start(gw, kind="chat", prompts=(), messages=(ChatTurn("user", "hi"),))
    [r] = gen.upstream_requests
    assert r.request.sampling.max_tokens == 64 - len(r.request.token_ids.ids)
    await gen.aclose()


async def test_sampling_mapping_with_n_seed_and_echo_logprobs():
    s = Sampling(max_tokens=3, temperature=0.0, top_p=0.5, seed=10, stop=("x",), logprobs=2)
    gen = await _start(_gateway(), prompts=("ab", (1, 2, 3)), n=2, echo=True, sampling=s)
    reqs = gen.upstream_requests
    assert len(reqs) == 4 and gen.choices == 4
    assert [r.request.sampling.seed for r in reqs] == [10, 11, 10, 11]
    assert [r.prompt_text for r in reqs] == ["ab", "ab", "\x01\x02\x03", "\x01\x02\x03"]
    sp = reqs[0].request.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, list(sp.stop), sp.logprobs, sp.prompt_logprobs) \
        == (3, 0.0, 0.5, ["x"], 2, 2)
    assert sp.HasField("temperature")  # 0 is sent, not left to a default
    assert gen.usage.prompt_tokens == 5  # each prompt once
    assert gen._gateway.admission.inflight_prompt_tokens == 10  # every copy admitted
    await gen.aclose()
    assert gen._gateway.admission.inflight_prompt_tokens == 0


async def test_context_length_exceeded_names_the_numbers():
    with pytest.raises(ApiError) as e:
        await _start(_gateway(max_model_len=10), sampling=Sampling(max_tokens=6))
    assert e.value.error_code == "context_length_exceeded"
    assert "maximum context length is 10 tokens" in e.value.message
    assert "requested 11 tokens (5 in the prompt, 6 in the completion)" in e.value.message
    with pytest.raises(ApiError):  # a prompt that fills the context leaves no room at all
        await _start(_gateway(max_model_len=5))


async def test_unknown_context_length_leaves_the_default_to_the_engine():
    gen = await _start(_gateway(max_model_len=0), kind="chat", prompts=(),
                       messages=(ChatTurn("user", "hi"),))
    assert not gen.upstream_requests[0].request.sampling.HasField("max_tokens")
    await gen.aclose()


async def test_admission_refusals():
    gw = _gateway(max_requests=2)
    held = await _start(gw, n=2)
    with pytest.raises(ApiError) as e:
        await _start(gw)
    assert (e.value.status, e.value.retry_after, e.value.error_code) == (503, 1, "overloaded")
    await held.aclose()
    await (await _start(gw)).aclose()
    assert gw.admission.inflight_requests == 0


async def test_bad_token_ids_and_empty_prompts():
    for prompt in ((999,), (), ""):
        with pytest.raises(ApiError) as e:
            await _start(_gateway(), prompts=(prompt,))
        assert e.value.param == "prompt"
