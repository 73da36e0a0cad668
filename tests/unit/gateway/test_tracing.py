"""Span attributes under the current OpenTelemetry GenAI semantic-convention names."""
from __future__ import annotations

import json

from kvmesh.grammar import Constraint, ConstraintKind
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.tracing import request_attributes as engine_attributes
from kvmesh.services.gateway import tracing
from kvmesh.services.gateway.spec import ChatTurn, GenerationRequest, Sampling, Usage

DEPRECATED = {"gen_ai.system", "gen_ai.prompt", "gen_ai.completion"}


def test_request_attributes_name_what_the_client_set():
    req = GenerationRequest(kind="completion", model="m", n=2, prompts=("a", "b"),
                            sampling=Sampling(max_tokens=8, temperature=0.5, top_k=4, seed=7, stop=("x",),
                                              constraint=Constraint(ConstraintKind.JSON_OBJECT)))
    assert tracing.request_attributes(req) == {
        "gen_ai.provider.name": "kvmesh", "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": "m", "gen_ai.request.max_tokens": 8, "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_k": 4, "gen_ai.request.seed": 7, "gen_ai.request.stop_sequences": ["x"],
        "gen_ai.request.choice.count": 2, "gen_ai.output.type": "json"}


def test_response_and_content_attributes():
    usage = Usage(prompt_tokens=10)
    usage.add_choice(0, 3, 4)
    attrs = tracing.response_attributes("chatcmpl-1", "m", usage, tracing.finish_reasons({0: "stop"}, 1))
    assert attrs == {"gen_ai.response.id": "chatcmpl-1", "gen_ai.response.model": "m",
                     "gen_ai.response.finish_reasons": ["stop"], "gen_ai.usage.input_tokens": 10,
                     "gen_ai.usage.output_tokens": 3, "gen_ai.usage.cache_read.input_tokens": 4}
    chat = GenerationRequest(kind="chat", model="m", sampling=Sampling(),
                             messages=(ChatTurn("system", "be brief"), ChatTurn("user", "hi")))
    content = tracing.content_attributes(chat, ["<rendered>"], ["hello", "hey"], ["stop", "length"])
    assert json.loads(content["gen_ai.input.messages"]) == [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {"role": "user", "parts": [{"type": "text", "content": "hi"}]}]
    assert [m["finish_reason"] for m in json.loads(content["gen_ai.output.messages"])] == ["stop", "length"]
    assert not DEPRECATED & (attrs.keys() | content.keys())


def test_engine_request_attributes():
    attrs = engine_attributes("m", SamplingParams(max_tokens=4, seed=1), "r1")
    assert attrs["gen_ai.provider.name"] == "kvmesh" and attrs["gen_ai.request.seed"] == 1
    assert attrs["gen_ai.operation.name"] == "text_completion" and "gen_ai.request.top_k" not in attrs
    assert not DEPRECATED & attrs.keys()
