"""Document-marked chat prompts (kvmesh extension): validation, the parts sent upstream, and the
`kvmesh` report in responses."""
from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from gateway_utils import tiny_tokenizer
from kvmesh.engine.v1 import engine_pb2
from kvmesh.gateway.v1 import gateway_pb2 as pb
from kvmesh.services.gateway import grpc_servicer
from kvmesh.services.gateway.admission import Admission, AdmissionLimits
from kvmesh.services.gateway.auth import KeyStore, Tenant
from kvmesh.services.gateway.errors import ApiError
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.gateway.openai_format import Formatter
from kvmesh.services.gateway.openai_schema import chat_request, completion_request, parse_body
from kvmesh.services.gateway.prompts import PromptBuilder, load_tokenizer
from kvmesh.services.gateway.service import Gateway, GatewayOptions
from kvmesh.services.gateway.spec import (
    ChatTurn,
    ChoiceDelta,
    DocumentRef,
    DocumentUsage,
    GenerationRequest,
    Limits,
    Retrieval,
    Sampling,
    Usage,
    validate_request,
)
from kvmesh.services.gateway.upstream import ModelEntry

START, END = 256, 257  # the tiny tokenizer's <|im_start|> and <|im_end|>; other ids are bytes
TENANT = Tenant("acme", "tenant:acme")
CONVERSATION = (ChatTurn("system", "Be brief."), ChatTurn("user", "first"),
                ChatTurn("assistant", "ok"), ChatTurn("user", "What is X?"))


def ids(*pieces: str | int) -> list[int]:
    """Token ids of the tiny tokenizer, written out: text is its bytes, ints are special ids."""
    return [t for p in pieces for t in ([p] if isinstance(p, int) else list(p.encode()))]


BEFORE = ids(START, "system\nBe brief.", END, "\n", START, "user\nfirst", END, "\n",
             START, "assistant\nok", END, "\n", START, "user\n")
AFTER = ids("What is X?", END, "\n", START, "assistant\n")
SEP = ids("\n\n")


class _Catalog:
    def __init__(self, max_model_len: int) -> None:
        self.entry = ModelEntry("m", "root", max_model_len, 0)

    async def get(self, model_id: str) -> ModelEntry:
        return self.entry


def _gateway(max_model_len: int = 256) -> Gateway:
    admission = Admission(AdmissionLimits(max_requests=8, max_prompt_tokens=1000))
    return Gateway(None, _Catalog(max_model_len),  # type: ignore[arg-type]
                   PromptBuilder(tiny_tokenizer()), KeyStore(None), admission, GatewayOptions(),
                   GatewayMetrics(CollectorRegistry()))


async def _start(gw: Gateway, **kw):
    base = dict(kind="chat", model="m", messages=CONVERSATION, sampling=Sampling())
    return await gw.start(GenerationRequest(**{**base, **kw}), TENANT, endpoint="t", arrival=0.0)


def _parts(request: engine_pb2.GenerateRequest) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for p in request.parts.parts:
        kind = p.WhichOneof("part")
        if kind in ("tokens", "document"):
            out.append((kind, list(getattr(p, kind).ids)))
        elif kind == "document_id":
            out.append((kind, p.document_id))
        else:
            out.append((kind, (p.retrieve.query, p.retrieve.k, list(p.retrieve.separator.ids))))
    return out


# --- the parts sent upstream ------------------------------------------------------------------

async def test_documents_and_retrieval_go_before_the_last_user_message_in_parts():
    gw = _gateway()
    gen = await _start(gw, n=2, recompute_ratio=0.25, retrieve=Retrieval(3),
                       documents=(DocumentRef(text="Doc one."), DocumentRef(id="cat-7")))
    first, second = gen.upstream_requests
    g = first.request
    assert g.WhichOneof("prompt") == "parts" and not g.HasField("token_ids")
    assert _parts(g) == [
        ("tokens", BEFORE),
        ("document", ids("Doc one.")), ("tokens", SEP),
        ("document_id", "cat-7"), ("tokens", SEP),
        ("retrieve", ("What is X?", 3, SEP)), ("tokens", SEP),  # query: the last user message
        ("tokens", AFTER)]
    assert g.blend.recompute_ratio == pytest.approx(0.25)
    assert _parts(second.request) == _parts(g)
    # Inline documents are in the text (for OpenAI-compatible tiers); catalogued ones cannot be.
    assert first.prompt_text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                 "first<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
                                 "<|im_start|>user\nDoc one.\n\nWhat is X?<|im_end|>\n"
                                 "<|im_start|>assistant\n")
    known = len(BEFORE) + len("Doc one.") + 3 * len(SEP) + len(AFTER)
    assert gen.usage.prompt_tokens == known
    assert gw.admission.inflight_prompt_tokens == 2 * known
    # Catalogued documents make the prompt's length unknown here: the engine's default applies.
    assert not g.sampling.HasField("max_tokens")
    assert gen.usage.documents == DocumentUsage()
    await gen.aclose()


async def test_inline_documents_only_keep_the_context_check_and_default():
    gw = _gateway(max_model_len=200)
    gen = await _start(gw, documents=(DocumentRef(text="AB"),),
                       retrieve=None, messages=(ChatTurn("user", "Q?"),))
    g = gen.upstream_requests[0].request
    assert _parts(g) == [("tokens", ids(START, "user\n")), ("document", ids("AB")),
                         ("tokens", SEP), ("tokens", ids("Q?", END, "\n", START, "assistant\n"))]
    assert not g.HasField("blend")  # no recompute_ratio: the engine's default
    known = len(ids(START, "user\n", "AB\n\nQ?", END, "\n", START, "assistant\n"))
    assert g.sampling.max_tokens == 200 - known  # the rest of the context, documents counted
    await gen.aclose()
    with pytest.raises(ApiError) as e:  # an inline document counts against the context
        await _start(_gateway(max_model_len=40), documents=(DocumentRef(text="x" * 30),),
                     messages=(ChatTurn("user", "Q?"),), sampling=Sampling(max_tokens=1))
    assert e.value.error_code == "context_length_exceeded"


async def test_an_explicit_query_and_retrieval_alone():
    gen = await _start(_gateway(), retrieve=Retrieval(16, "x definition"))
    assert _parts(gen.upstream_requests[0].request) == [
        ("tokens", BEFORE), ("retrieve", ("x definition", 16, SEP)), ("tokens", SEP),
        ("tokens", AFTER)]
    assert gen.upstream_requests[0].prompt_text.endswith(
        "<|im_start|>user\nWhat is X?<|im_end|>\n<|im_start|>assistant\n")
    await gen.aclose()


async def test_plain_chat_still_sends_token_ids():
    gen = await _start(_gateway())
    g = gen.upstream_requests[0].request
    assert g.WhichOneof("prompt") == "token_ids" and list(g.token_ids.ids) == BEFORE + AFTER
    assert not g.HasField("blend") and gen.usage.documents is None
    await gen.aclose()


@pytest.mark.slow
async def test_parts_with_the_bundled_tokenizer():
    tok = load_tokenizer("bundled")
    builder = PromptBuilder(tok)
    p = await builder.chat_with_documents(
        (ChatTurn("system", "Be brief."), ChatTurn("user", "What is X?")),
        (DocumentRef(text="X is a letter."), DocumentRef(id="cat-7")), Retrieval(2))
    before = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    after = "What is X?<|im_end|>\n<|im_start|>assistant\n"
    enc = lambda text: tuple(tok.encode(text, False))  # noqa: E731
    [im_start] = enc("<|im_start|>")
    sep = enc("\n\n")
    kinds = [type(part).__name__ for part in p.parts]
    assert kinds == ["Tokens", "InlineDocument", "Tokens", "CatalogDocument",
                     "Tokens", "Retrieval", "Tokens", "Tokens"]
    assert p.parts[0].ids == enc(before) and p.parts[0].ids[0] == im_start
    assert p.parts[1].ids == enc("X is a letter.") and p.parts[2].ids == sep
    assert p.parts[3].document_id == "cat-7"
    assert (p.parts[5].query, p.parts[5].k, p.parts[5].separator) == ("What is X?", 2, sep)
    assert p.parts[7].ids == enc(after)
    assert p.text == before + "X is a letter.\n\n" + after
    inline = [t for part in p.parts[:3] for t in part.ids]
    assert tok.decode(inline, skip_special_tokens=False) == before + "X is a letter.\n\n"


# --- validation -----------------------------------------------------------------------------

def _error(body: dict, messages=None) -> ApiError:
    raw = json.dumps({"model": "m", "messages": messages or [{"role": "user", "content": "q"}],
                      **body})
    with pytest.raises(ApiError) as e:
        validate_request(chat_request(parse_body(raw.encode(), "chat")), Limits())
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("body, param, code, says", [
    ({"documents": [{}]}, "documents[0]", "invalid_value", "exactly one of 'id'"),
    ({"documents": [{"id": "a"}, {"id": "b", "text": "t"}]}, "documents[1]", "invalid_value",
     "exactly one of 'id'"),
    ({"documents": [{"text": ""}]}, "documents[0].text", "invalid_value", "is empty"),
    ({"documents": [{"id": ""}]}, "documents[0].id", "invalid_value", "is empty"),
    ({"documents": [{"text": 5}]}, "documents[0].text", "invalid_type", "string"),
    ({"documents": {"id": "a"}}, "documents", "invalid_type", "list"),
    ({"retrieve": {}}, "retrieve.top_k", "missing_required_parameter", "missing"),
    ({"retrieve": {"top_k": 0}}, "retrieve.top_k", "invalid_value", "1..16"),
    ({"retrieve": {"top_k": 17}}, "retrieve.top_k", "invalid_value", "1..16"),
    ({"retrieve": {"top_k": "3"}}, "retrieve.top_k", "invalid_type", "integer"),
    ({"retrieve": {"top_k": 2, "query": " "}}, "retrieve.query", "invalid_value", "leave it out"),
    ({"documents": [{"id": "a"}], "recompute_ratio": 1.5}, "recompute_ratio", "invalid_value",
     "[0, 1]"),
    ({"documents": [{"id": "a"}], "recompute_ratio": -0.1}, "recompute_ratio", "invalid_value",
     "[0, 1]"),
    ({"documents": [{"id": "a"}], "recompute_ratio": "0.5"}, "recompute_ratio", "invalid_type",
     "number"),
    ({"recompute_ratio": 0.5}, "recompute_ratio", "invalid_value", "needs documents or retrieve"),
    ({"documents": [], "recompute_ratio": 0.5}, "recompute_ratio", "invalid_value",
     "needs documents or retrieve"),
])
def test_bad_document_fields_are_400_naming_the_field(body, param, code, says):
    err = _error(body)
    assert (err.param, err.error_code) == (param, code), err.message
    assert says in err.message


def test_documents_need_a_user_message_and_retrieval_some_text():
    err = _error({"documents": [{"id": "a"}]}, [{"role": "system", "content": "s"}])
    assert err.param == "messages" and "user message" in err.message
    err = _error({"retrieve": {"top_k": 1}}, [{"role": "user", "content": " "}])
    assert err.param == "retrieve.query" and "no text" in err.message


def test_a_nan_recompute_ratio_is_refused():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "q"}], ' \
          b'"documents": [{"id": "a"}], "recompute_ratio": NaN}'
    with pytest.raises(ApiError) as e:
        validate_request(chat_request(parse_body(raw, "chat")), Limits())
    assert e.value.param == "recompute_ratio"


@pytest.mark.parametrize("name, value", [("documents", [{"id": "a"}]),
                                         ("retrieve", {"top_k": 1}), ("recompute_ratio", 0.5)])
def test_completions_refuse_the_document_fields(name, value):
    raw = json.dumps({"model": "m", "prompt": "p", name: value}).encode()
    with pytest.raises(ApiError) as e:
        completion_request(parse_body(raw, "completion"))
    assert (e.value.param, e.value.error_code) == (name, "unsupported_parameter")
    assert "chat completions" in e.value.message


def test_http_and_grpc_fields_map_to_the_same_request():
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}],
            "documents": [{"id": "a"}, {"text": "t"}], "retrieve": {"top_k": 2},
            "recompute_ratio": 0.5}
    http = chat_request(parse_body(json.dumps(body).encode(), "chat"))
    grpc = grpc_servicer.chat_request(pb.ChatCompleteRequest(
        model="m", messages=[pb.ChatMessage(role=pb.ROLE_USER, content="q")],
        documents=[pb.Document(id="a"), pb.Document(text="t")], retrieve=pb.Retrieve(top_k=2),
        recompute_ratio=0.5))
    for req in (http, grpc):
        assert req.documents == (DocumentRef(id="a"), DocumentRef(text="t"))
        assert req.retrieve == Retrieval(2, None) and req.recompute_ratio == 0.5
        assert req.uses_documents
        validate_request(req, Limits())
    plain = grpc_servicer.chat_request(pb.ChatCompleteRequest(
        model="m", messages=[pb.ChatMessage(role=pb.ROLE_USER, content="q")],
        documents=[pb.Document()], retrieve=pb.Retrieve(top_k=1, query="z")))
    assert plain.retrieve == Retrieval(1, "z") and plain.recompute_ratio is None
    with pytest.raises(ApiError) as e:  # a Document with neither id nor text
        validate_request(plain, Limits())
    assert e.value.param == "documents[0]"


# --- the report in responses ----------------------------------------------------------------

def test_usage_takes_the_engines_prompt_count_and_the_best_report():
    u = Usage(prompt_tokens=40, documents=DocumentUsage())
    u.add_choice(0, 3, 0)
    u.add_documents(90, DocumentUsage(("d1", "d2"), 30, 3))
    u.add_choice(0, 4, 0)
    u.add_documents(90, DocumentUsage(("d1", "d2"), 10, 1))  # a copy that reused less
    assert (u.prompt_tokens, u.completion_tokens) == (90, 7)
    assert u.documents == DocumentUsage(("d1", "d2"), 30, 3)
    v = Usage(prompt_tokens=40, documents=DocumentUsage())
    v.add_documents(40, DocumentUsage(("d9",), 0, 0))  # nothing blended is still a report
    assert v.documents == DocumentUsage(("d9",), 0, 0)


def test_the_kvmesh_object_is_in_the_response_and_the_usage_chunk_only_with_documents():
    report = {"document_ids": ["d1", "d2"], "blended_tokens": 30, "recomputed_tokens": 3}
    with_docs = Usage(prompt_tokens=90, documents=DocumentUsage(("d1", "d2"), 30, 3))
    f = Formatter("chat", "c", 1, "m", logprobs=False, include_usage=True)
    f.add(ChoiceDelta(0, "hi", finish_reason="stop", first=True))
    body = f.response(with_docs)
    assert body["kvmesh"] == report and body["usage"]["prompt_tokens"] == 90
    assert f.usage_chunk(with_docs)["kvmesh"] == report
    assert all("kvmesh" not in c for c in f.chunks(ChoiceDelta(0, "x")))
    assert "kvmesh" not in f.response(Usage(prompt_tokens=9))
    assert "kvmesh" not in f.usage_chunk(Usage(prompt_tokens=9))
    json.dumps(body)
