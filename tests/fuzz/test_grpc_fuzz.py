"""Hypothesis-generated protobuf requests against every kvmesh gRPC API, served for real.

Each test starts one service the way its own service tests do (gateway: GatewayHarness in front of
the fake router; router: serving_router over fake engines, a cascade included; engine: the tiny
random-weight model behind serve_engine, a KV service behind it; kvcache: memory + LMDB tiers
with the word embedder; draft: the n-gram service), then sends `n_cases` requests drawn by tests/fuzz/proto_strategies.py
to all of its methods, as raw bytes with random metadata. It counts the answers by status and
fails on UNKNOWN, INTERNAL or DATA_LOSS, on a hang, or on an error without a message; afterwards
the server must still answer health SERVING and serve a valid request. `pytest -s` prints the
counts.
"""
from __future__ import annotations

import grpc
import pytest
import torch
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from fuzz.background import LoopThread
from fuzz.grpc_fuzz import Case, RawCaller, Tally, fuzz, metadata
from fuzz.proto_strategies import Generator, requests

from kvmesh.common.v1 import common_pb2
from kvmesh.draft.v1 import draft_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.gateway.v1 import gateway_pb2
from kvmesh.kv import codec
from kvmesh.kv.keys import KEY_BYTES
from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.kv.namespace_proto import namespace_to_proto
from kvmesh.kv.quality import LOSSY_KV_CODECS
from kvmesh.kv.transfer import put_requests
from kvmesh.kvcache.v1 import kvcache_pb2
from kvmesh.router.v1 import router_pb2

def cases(service: ServiceDescriptor, gen: Generator, seeds: dict[str, list],
          streams: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy[Case]:
    """Cases for every method of `service`: requests from `gen` around the method's `seeds`;
    a client-streaming method draws its whole stream from `streams`."""
    per_method = []
    for m in service.methods:
        if m.client_streaming:
            body = streams[m.name]
        else:
            body = requests(m, gen, seeds.get(m.name, ()))
        per_method.append(st.builds(Case, st.just(m), body, metadata.map(tuple)))
    return st.one_of(per_method)


def check_still_serving(caller: RawCaller, case: Case) -> None:
    """The server answers health SERVING and still serves `case` (a valid request)."""
    assert caller.healthy(), f"{caller.service.full_name} no longer answers health SERVING"
    outcome = caller.call(case)
    assert outcome.code is grpc.StatusCode.OK, f"a valid request now fails: {outcome}"


def case_of(service: ServiceDescriptor, name: str, request: Message) -> Case:
    return Case(service.methods_by_name[name], request.SerializeToString())


# ---- gateway ----------------------------------------------------------------------------------

GATEWAY = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]


@pytest.fixture(scope="module")
def gateway():
    from gateway_utils import GatewayHarness

    with GatewayHarness() as h:
        caller = RawCaller(h.grpc_address, GATEWAY)
        yield caller
        caller.close()


def test_gateway_grpc(gateway, n_cases):
    from gateway_utils import MODEL

    p = "kvmesh.gateway.v1."
    models = st.sampled_from([MODEL, "cascade"])
    gen = Generator({
        p + "CompleteRequest.model": models, p + "ChatCompleteRequest.model": models,
        p + "GenerationOptions.max_tokens": st.integers(1, 8), p + "GenerationOptions.n": st.integers(1, 3),
        p + "GenerationOptions.logprobs": st.integers(0, 5),
        p + "LossyReuse.kv_codec": st.sampled_from(LOSSY_KV_CODECS),
        p + "ChatMessage.role": st.integers(1, 5), "kvmesh.common.v1.TokenIds.ids": st.integers(0, 257),
        p + "TokenizeRequest.model": models, p + "DetokenizeRequest.tokens": st.integers(0, 300),
        p + "GenerationOptions.min_tokens": st.integers(0, 8), p + "GenerationOptions.top_k": st.integers(-2, 50)})
    user = gateway_pb2.ChatMessage(role=gateway_pb2.ROLE_USER, content="hi")
    seeds = {
        "Complete": [gateway_pb2.CompleteRequest(model=MODEL, text="hi"),
                     gateway_pb2.CompleteRequest(model=MODEL, token_ids=common_pb2.TokenIds(ids=[104, 105]),
                                                 echo=True, options=gateway_pb2.GenerationOptions(logprobs=2))],
        "ChatComplete": [
            gateway_pb2.ChatCompleteRequest(model=MODEL, messages=[user]),
            gateway_pb2.ChatCompleteRequest(model="cascade", messages=[user],
                                            documents=[gateway_pb2.Document(text="doc")],
                                            retrieve=gateway_pb2.Retrieve(top_k=2), recompute_ratio=0.5),
            gateway_pb2.ChatCompleteRequest(model=MODEL, messages=[user], options=gateway_pb2.GenerationOptions(
                n=2, stop=[" the"], lossy=gateway_pb2.LossyReuse(kv_codec="int8"))),
            gateway_pb2.ChatCompleteRequest(
                model=MODEL, messages=[user], tools=[gateway_pb2.Tool(name="f", parameters='{"type": "object"}')],
                tool_choice=gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED),
                options=gateway_pb2.GenerationOptions(presence_penalty=0.5, logit_bias={104: 2.0}, min_tokens=1,
                                                      stop_token_ids=[3], top_k=5, min_p=0.1)),
            gateway_pb2.ChatCompleteRequest(model=MODEL, messages=[user], options=gateway_pb2.GenerationOptions(
                response_format=gateway_pb2.ResponseFormat(
                    type=gateway_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
                    json_schema=gateway_pb2.JsonSchema(name="s", schema='{"type": "integer"}'))))],
        "Tokenize": [gateway_pb2.TokenizeRequest(model=MODEL, prompt="hi", return_token_strs=True),
                     gateway_pb2.TokenizeRequest(messages=[user], add_generation_prompt=False)],
        "Detokenize": [gateway_pb2.DetokenizeRequest(model=MODEL, tokens=[104, 105])],
        "Embed": [gateway_pb2.EmbedRequest(model="all-MiniLM-L6-v2", input=["hi"])]}
    tally = Tally("gateway GatewayService")
    fuzz(gateway, cases(GATEWAY, gen, seeds), n_cases, tally)
    check_still_serving(gateway, case_of(GATEWAY, "ChatComplete", seeds["ChatComplete"][0]))


# ---- router -----------------------------------------------------------------------------------

ROUTER = router_pb2.DESCRIPTOR.services_by_name["RouterService"]


@pytest.fixture(scope="module")
def router():
    from router_utils import Script, fake_engines, router_config, serving_router

    with LoopThread("fuzz-router") as loop:
        # `top` given: a fake engine otherwise makes as many alternatives as a request's logprobs
        # asks for (up to 2**32; a real engine refuses more than 20)
        top = [[-0.1, -1.0, -2.0]] * 3
        cheap, strong = loop.enter(fake_engines(Script(logprobs=[-0.1, -3.0, -0.2], top=top),
                                                Script(cached_tokens=16, top=top)))
        cfg = router_config(tiers=f"cheap={cheap.address};strong={strong.address},{cheap.address}",
                            cascades="auto=cheap,strong")
        served = loop.enter(serving_router(cfg))
        caller = RawCaller(served.address, ROUTER)
        yield caller
        caller.close()


def test_router_grpc(router, n_cases):
    gen = Generator(_engine_hints() | {
        "kvmesh.router.v1.RouteRequest.model": st.sampled_from(["cheap", "strong", "auto", ""]),
        "kvmesh.router.v1.RouteRequest.cascade_threshold": st.floats(-10, 0)})

    def route(**kw) -> router_pb2.RouteRequest:
        request = kw.pop("request", engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1, 2, 3])))
        return router_pb2.RouteRequest(request=request, tenant="t1", **kw)

    seeds = {"Generate": [
        route(model="cheap"), route(model="auto", cascade_threshold=-0.5),
        route(model="strong", prompt_text="a b c", request=engine_pb2.GenerateRequest(
            text="a b c", sampling=engine_pb2.SamplingParams(max_tokens=3, logprobs=2, seed=1))),
        route(model="auto", request=engine_pb2.GenerateRequest(parts=engine_pb2.Prompt(parts=[
            engine_pb2.PromptPart(tokens=common_pb2.TokenIds(ids=[1, 2])),
            engine_pb2.PromptPart(document=common_pb2.TokenIds(ids=[3, 4]))])))]}
    tally = Tally("router RouterService")
    fuzz(router, cases(ROUTER, gen, seeds), n_cases, tally)
    check_still_serving(router, case_of(ROUTER, "Generate", seeds["Generate"][0]))


# ---- engine -----------------------------------------------------------------------------------

ENGINE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]


def _engine_hints() -> dict[str, st.SearchStrategy]:
    p = "kvmesh.engine.v1."
    documents = st.sampled_from(["d", "e"])
    return {p + "SamplingParams.max_tokens": st.integers(1, 6), p + "SamplingParams.temperature": st.floats(0, 2),
            p + "SamplingParams.top_p": st.floats(0.01, 1), p + "SamplingParams.logprobs": st.integers(0, 3),
            p + "SamplingParams.prompt_logprobs": st.integers(0, 3),
            p + "GenerateRequest.speculation": st.integers(0, 4), p + "KvStorage.codec": st.integers(0, 6),
            p + "PromptPart.document_id": documents, p + "IngestDocumentRequest.document_id": documents,
            "kvmesh.common.v1.TokenIds.ids": st.integers(0, 257)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engine_utils import load_tiny, make_core, make_tiny_checkpoint, serve_engine
    from kvcache_utils import WordEmbedder, serving

    torch.set_num_threads(1)
    loaded = load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    with LoopThread("fuzz-engine") as loop:
        # a KV service behind it, so that documents, ingestion and KV export are reached too
        kv = loop.enter(serving(_kvcache_config(tmp_path_factory), embedder=WordEmbedder()))
        # max_model_len 48: a valid request generates at most that many tokens, so every case is quick
        core = make_core(loaded, num_blocks=64, max_model_len=48, kvcache_address=kv.address,
                         kv_chunk_tokens=16)
        served = loop.enter(serve_engine(core))
        caller = RawCaller(served.address, ENGINE)
        yield caller
        caller.close()


def test_engine_grpc(engine, n_cases):
    prompt = common_pb2.TokenIds(ids=[72, 105, 33])
    sampling = engine_pb2.SamplingParams(max_tokens=4)
    seeds = {
        "Generate": [
            engine_pb2.GenerateRequest(token_ids=prompt, sampling=sampling),
            engine_pb2.GenerateRequest(request_id="r1", text="Hello", sampling=engine_pb2.SamplingParams(
                max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, seed=3, logprobs=2, prompt_logprobs=1,
                stop=["a"], stop_token_ids=[256])),
            engine_pb2.GenerateRequest(token_ids=prompt, sampling=engine_pb2.SamplingParams(
                max_tokens=4, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                logit_bias={65: 2.0}, min_p=0.1, min_tokens=2,
                structured_output=engine_pb2.StructuredOutput(regex="[a-c]+"))),
            engine_pb2.GenerateRequest(token_ids=prompt, sampling=engine_pb2.SamplingParams(
                max_tokens=4, structured_output=engine_pb2.StructuredOutput(
                    choice=engine_pb2.Choices(choices=["yes", "no"])))),
            engine_pb2.GenerateRequest(token_ids=prompt, sampling=sampling, resume_token_ids=common_pb2.TokenIds(
                ids=[1]), speculation=engine_pb2.SPECULATION_NGRAM,
                kv_storage=engine_pb2.KvStorage(codec=engine_pb2.KV_CODEC_INT8)),
            engine_pb2.GenerateRequest(sampling=sampling, parts=engine_pb2.Prompt(parts=[
                engine_pb2.PromptPart(tokens=common_pb2.TokenIds(ids=[1, 2])),
                engine_pb2.PromptPart(document=common_pb2.TokenIds(ids=[3, 4, 5]))]),
                blend=engine_pb2.BlendOptions(recompute_ratio=0.5)),
            engine_pb2.GenerateRequest(sampling=sampling, parts=engine_pb2.Prompt(parts=[
                engine_pb2.PromptPart(document_id="e"), engine_pb2.PromptPart(retrieve=engine_pb2.Retrieve(
                    query="some text", k=1)), engine_pb2.PromptPart(tokens=common_pb2.TokenIds(ids=[9]))]))],
        "Probe": [engine_pb2.ProbeRequest(token_ids=prompt)],
        "Abort": [engine_pb2.AbortRequest(request_id="r1")],
        "IngestDocument": [engine_pb2.IngestDocumentRequest(document_id="d", text="some text " * 4),
                           engine_pb2.IngestDocumentRequest(document_id="e", token_ids=common_pb2.TokenIds(
                               ids=list(range(40, 72))), pinned=True)]}
    tally = Tally("engine EngineService")
    fuzz(engine, cases(ENGINE, Generator(_engine_hints()), seeds), n_cases, tally)
    check_still_serving(engine, case_of(ENGINE, "Generate", seeds["Generate"][0]))


# ---- kvcache ----------------------------------------------------------------------------------

KVCACHE = kvcache_pb2.DESCRIPTOR.services_by_name["KvcacheService"]
CATALOG = kvcache_pb2.DESCRIPTOR.services_by_name["KvCatalogService"]
NAMESPACE = KvNamespace("fuzz-model", KvLayout(2, 2, 8, "float32"))


def _blob(tokens: list[int]) -> bytes:
    g = torch.Generator().manual_seed(len(tokens))
    k, v = torch.randn(2, len(tokens), 2, 8, generator=g), torch.randn(2, len(tokens), 2, 8, generator=g)
    return codec.encode(k, v, codec.ChunkMeta(NAMESPACE.digest(), tuple(tokens)), codec.CodecSpec("fp16", zstd=False))


def _kvcache_config(tmp_path_factory):
    from kvmesh.services.kvcache.config import KvcacheConfig

    return KvcacheConfig(data_dir=tmp_path_factory.mktemp("lmdb"), memory_bytes=1 << 20,
                         disk_map_bytes=16 << 20, max_entry_bytes=1 << 20)


@pytest.fixture(scope="module")
def kvcache(tmp_path_factory):
    from kvcache_utils import WordEmbedder, serving

    with LoopThread("fuzz-kvcache") as loop:
        served = loop.enter(serving(_kvcache_config(tmp_path_factory), embedder=WordEmbedder()))
        callers = RawCaller(served.address, KVCACHE), RawCaller(served.address, CATALOG)
        yield callers
        for caller in callers:
            caller.close()


def test_kvcache_grpc(kvcache, n_cases):
    blobs, catalog = kvcache
    keys = [bytes([i]) * KEY_BYTES for i in range(4)]
    ns = namespace_to_proto(NAMESPACE)
    p = "kvmesh.kvcache.v1."
    key = st.one_of(st.sampled_from(keys), st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES))
    gen = Generator({
        **{p + f"{m}.keys": key for m in ("LookupRequest", "GetRequest", "DeleteRequest", "PinRequest",
                                           "SetTtlRequest")},
        p + "PutHeader.key": key, p + "PutDocumentRequest.chunk_keys": key,
        "kvmesh.common.v1.KvNamespace.model_identity": st.just(NAMESPACE.model_identity),
        **{p + f"{m}.namespace": st.just(ns) for m in (
            "PutHeader", "SearchRequest", "PutDocumentRequest", "GetDocumentRequest", "ListDocumentsRequest",
            "DeleteDocumentRequest", "PinDocumentRequest", "SetDocumentTtlRequest")},
        **{p + f"{m}.document_id": st.sampled_from(["doc-a", "doc-b"]) for m in (
            "PutDocumentRequest", "GetDocumentRequest", "DeleteDocumentRequest", "PinDocumentRequest",
            "SetDocumentTtlRequest")},
        p + "PutHeader.total_bytes": st.integers(1, 4096), p + "SearchRequest.k": st.integers(0, 20),
        p + "Embedding.values": st.floats(-1, 1, width=32)})
    seeds = {
        "Lookup": [kvcache_pb2.LookupRequest(keys=keys, chunk_tokens=16)],
        "Get": [kvcache_pb2.GetRequest(keys=keys[:2])],
        "Delete": [kvcache_pb2.DeleteRequest(keys=keys[3:])],
        "Pin": [kvcache_pb2.PinRequest(keys=keys[:1], pinned=True)],
        "SetTtl": [kvcache_pb2.SetTtlRequest(keys=keys[:1], ttl_s=60)],
        "Search": [kvcache_pb2.SearchRequest(namespace=ns, text="fuzz words", k=3)],
        "PutDocument": [kvcache_pb2.PutDocumentRequest(namespace=ns, document_id="doc-a", text="fuzz words",
                                                       chunk_keys=keys[:2], token_ids=[1, 2])],
        "GetDocument": [kvcache_pb2.GetDocumentRequest(namespace=ns, document_id="doc-a")],
        "ListDocuments": [kvcache_pb2.ListDocumentsRequest(namespace=ns, page_size=1)],
        "DeleteDocument": [kvcache_pb2.DeleteDocumentRequest(namespace=ns, document_id="doc-b")],
        "PinDocument": [kvcache_pb2.PinDocumentRequest(namespace=ns, document_id="doc-a", pinned=True)],
        "SetDocumentTtl": [kvcache_pb2.SetDocumentTtlRequest(namespace=ns, document_id="doc-a", ttl_s=60)]}
    valid_puts = [tuple(m.SerializeToString() for m in put_requests(k, _blob(list(range(16))), NAMESPACE,
                                                                   part_bytes=700))
                  for k in keys[:2]]
    put = KVCACHE.methods_by_name["Put"]
    part = requests(put, gen, [kvcache_pb2.PutRequest(data=b"x" * 10)])

    @st.composite
    def changed_put(draw) -> tuple[bytes, ...]:
        stream = list(draw(st.sampled_from(valid_puts)))
        i = draw(st.integers(0, len(stream) - 1))
        how = draw(st.sampled_from(["replace", "drop", "repeat", "insert"]))
        if how == "replace":
            stream[i] = draw(part)
        elif how == "drop":
            del stream[i]
        elif how == "repeat":
            stream.insert(i, stream[i])
        else:
            stream.insert(i, draw(part))
        return tuple(stream)

    streams = {"Put": st.one_of(st.sampled_from(valid_puts), changed_put(),
                                st.lists(part, max_size=4).map(tuple))}
    blob_tally, catalog_tally = Tally("kvcache KvcacheService"), Tally("kvcache KvCatalogService")
    half = max(n_cases // 2, 1)
    fuzz(blobs, cases(KVCACHE, gen, seeds, streams), half, blob_tally)
    fuzz(catalog, cases(CATALOG, gen, seeds), n_cases - half, catalog_tally)
    check_still_serving(blobs, Case(put, valid_puts[0]))
    check_still_serving(catalog, case_of(CATALOG, "Search", seeds["Search"][0]))


# ---- draft ------------------------------------------------------------------------------------

DRAFT = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]


@pytest.fixture(scope="module")
def draft():
    from draft_utils import draft_config, serving_draft

    with LoopThread("fuzz-draft") as loop:
        served = loop.enter(serving_draft(draft_config()))
        caller = RawCaller(served.address, DRAFT)
        yield caller
        caller.close()


def test_draft_grpc(draft, n_cases):
    from draft_utils import TARGET, propose, seq

    p = "kvmesh.draft.v1."
    gen = Generator({
        p + "SequenceDraftRequest.sequence_id": st.sampled_from(["s/a", "s/b", "e/c"]),
        p + "SequenceDraftRequest.new_token_ids": st.integers(0, 8),
        p + "SequenceDraftRequest.resync": st.integers(0, 8),
        p + "SequenceDraftRequest.committed_len": st.integers(0, 12),
        p + "SequenceDraftRequest.max_draft_tokens": st.integers(0, 17),
        p + "SequenceDraftRequest.last_accepted": st.integers(0, 8),
        p + "SequenceDraftRequest.drafter": st.integers(0, 4),
        p + "ProposeRequest.target_model": st.sampled_from(["", TARGET]),
        p + "ReleaseRequest.sequence_ids": st.sampled_from(["s/a", "s/b"])})
    seeds = {"Propose": [propose([seq("s/a", [1, 2, 3, 1, 2], k=3)]),
                         propose([seq("s/a", [3], committed=6, k=2, last_accepted=1),
                                  seq("s/b", [], resync=[5, 6, 5], k=4)], TARGET)],
             "Release": [draft_pb2.ReleaseRequest(sequence_ids=["s/a"])]}
    tally = Tally("draft DraftService")
    fuzz(draft, cases(DRAFT, gen, seeds), n_cases, tally)
    check_still_serving(draft, case_of(DRAFT, "Propose", seeds["Propose"][0]))
