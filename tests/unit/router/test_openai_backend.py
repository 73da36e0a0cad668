"""The OpenAI-compatible backend against a tiny FastAPI endpoint served by uvicorn on port 0."""
from __future__ import annotations

import grpc
import httpx
import pytest

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.services.router.backends import BackendError
from kvmesh.services.router.openai_backend import OpenAIBackend, completion_body
from kvmesh.services.router.topology import Replica
from router_utils import FakeOpenAI, dead_address, serving_openai


def request(**sampling) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="r1", token_ids=common_pb2.TokenIds(ids=[1, 2]),
                                      sampling=engine_pb2.SamplingParams(**sampling))


async def run(fake: FakeOpenAI, req: engine_pb2.GenerateRequest, prompt: str = "Hi"):
    backend = OpenAIBackend(Replica(fake.url, "openai", fake.model), httpx.AsyncClient())
    try:
        return [m async for m in backend.generate(req, prompt, timeout=5)]
    finally:
        await backend.close()


def test_completion_body_sends_only_what_is_set():
    assert completion_body(request(), "m", "Hi") == {
        "model": "m", "prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}}
    body = completion_body(request(max_tokens=8, temperature=0.5, logprobs=2, stop=["\n"],
                                   stop_token_ids=[7], ignore_eos=True, seed=3), "m", "Hi")
    assert (body["max_tokens"], body["temperature"], body["logprobs"], body["seed"]) == (8, 0.5, 2, 3)
    assert (body["stop"], body["stop_token_ids"], body["ignore_eos"]) == (["\n"], [7], True)


def test_completion_body_sends_the_extras_and_structured_output_as_vllm_fields():
    body = completion_body(request(presence_penalty=0.5, repetition_penalty=1.5, min_p=0.25, min_tokens=2,
                                   logit_bias={7: -100.0}, structured_output=engine_pb2.StructuredOutput(
                                       json_schema='{"type": "object"}')), "m", "Hi")
    assert (body["presence_penalty"], body["repetition_penalty"], body["min_p"], body["min_tokens"]) == \
        (0.5, 1.5, 0.25, 2)
    assert body["logit_bias"] == {"7": -100.0} and body["guided_json"] == {"type": "object"}
    assert "frequency_penalty" not in body
    for so, field, value in [(engine_pb2.StructuredOutput(regex="a+"), "guided_regex", "a+"),
                             (engine_pb2.StructuredOutput(choice=engine_pb2.Choices(choices=["x"])),
                              "guided_choice", ["x"]),
                             (engine_pb2.StructuredOutput(grammar='start: "x"'), "guided_grammar", 'start: "x"'),
                             (engine_pb2.StructuredOutput(json_object=engine_pb2.AnyJsonObject()),
                              "response_format", {"type": "json_object"})]:
        assert completion_body(request(structured_output=so), "m", "Hi")[field] == value


async def test_stream_maps_text_logprobs_and_usage():
    async with serving_openai(FakeOpenAI()) as fake:
        msgs = await run(fake, request(logprobs=2))
    assert [m.delta.text for m in msgs] == ["Hello", ",", " world", ""] and msgs[-1].HasField("final")
    assert all(m.request_id == "r1" for m in msgs)
    lp = msgs[0].delta.logprobs[0]
    assert (lp.chosen.text, lp.chosen.logprob, lp.chosen.token_id) == ("Hello", pytest.approx(-0.05), 0)
    assert [(t.text, round(t.logprob, 2)) for t in lp.top] == [("Hello", -0.05), ("alt", -2.05)]
    final = msgs[-1].final
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (7, 3)


async def test_without_usage_each_chunk_counts_as_a_token():
    async with serving_openai(FakeOpenAI(send_usage=False, pieces=("a", "b"))) as fake:
        msgs = await run(fake, request())
    assert not msgs[0].delta.logprobs and msgs[-1].final.usage.completion_tokens == 2


@pytest.mark.parametrize("status, code", [(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                          (400, grpc.StatusCode.INVALID_ARGUMENT),
                                          (503, grpc.StatusCode.UNAVAILABLE)])
async def test_http_errors_map_to_status_codes(status, code):
    async with serving_openai(FakeOpenAI(status=status)) as fake:
        with pytest.raises(BackendError) as err:
            await run(fake, request())
    assert err.value.code == code and f"HTTP {status}" in err.value.message


async def test_a_refused_connection_is_unavailable_and_text_is_required():
    fake = FakeOpenAI(url=f"http://{dead_address()}/v1")
    with pytest.raises(BackendError) as err:
        await run(fake, request())
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.replica_down
    with pytest.raises(BackendError) as err:
        await run(fake, request(), prompt="")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_text" in err.value.message


async def test_model_info_from_v1_models():
    async with serving_openai(FakeOpenAI(model="m1", max_model_len=1024)) as fake:
        backend = OpenAIBackend(Replica(fake.url, "openai", "m1"), httpx.AsyncClient())
        info = await backend.model_info(5)
        missing = OpenAIBackend(Replica(fake.url, "openai", "m2"), httpx.AsyncClient())
        with pytest.raises(BackendError) as err:
            await missing.model_info(5)
        await backend.close()
        await missing.close()
    assert (info.root, info.max_model_len) == ("m1-root", 1024)
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "it serves: m1" in err.value.message
