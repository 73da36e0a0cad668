"""The gateway's vLLM-shaped extras: POST /tokenize, POST /detokenize, GET /tokenizer_info,
POST /v1/embeddings (the KV service's real all-MiniLM-L6-v2, behind a real KV-cache server),
GET /version and GET /docs — shapes, status codes, and errors that say what to fix; and the same
through the gRPC API (Tokenize, Detokenize, GetTokenizerInfo, Embed, GetVersion), which answers as
the HTTP endpoints do, errors included."""
from __future__ import annotations

import asyncio
import threading

import grpc
import httpx
import numpy as np
import openai
import pytest

from gateway_utils import CHATML, MAX_MODEL_LEN, MODEL, GatewayHarness
from kvcache_utils import serving
from kvmesh import __version__
from kvmesh.embed import NAME, Embedder
from kvmesh.gateway.v1 import gateway_pb2 as gpb
from kvmesh.gateway.v1 import gateway_pb2_grpc
from kvmesh.services.kvcache.config import KvcacheConfig


class KvcacheThread:
    """A real KV-cache server (with the real embedder) on a loop of its own."""

    def __init__(self, cfg: KvcacheConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.cm = serving(cfg, embedder=Embedder())

    def __enter__(self) -> str:
        self.thread.start()
        srv = asyncio.run_coroutine_threadsafe(self.cm.__aenter__(), self.loop).result(60)
        return srv.address

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.cm.__aexit__(None, None, None), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def embedding_gateway(tmp_path_factory):
    cfg = KvcacheConfig(data_dir=tmp_path_factory.mktemp("kv") / "lmdb", disk_map_bytes=64 << 20, max_entry_bytes=8 << 20)
    with KvcacheThread(cfg) as address, GatewayHarness(kvcache_address=address) as h:
        yield h


@pytest.fixture(scope="module")
def reference():
    return Embedder()


def _root(h: GatewayHarness) -> str:
    return h.base_url.removesuffix("/v1")


def _post(h: GatewayHarness, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(_root(h) + path, json=body, headers=headers, timeout=60)


def _error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


# --- /tokenize, /detokenize, /tokenizer_info ------------------------------------------------------

def test_tokenize_a_prompt_as_vllm_does(gateway):
    r = _post(gateway, "/tokenize", {"model": MODEL, "prompt": "Hi <|im_end|>", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == gateway.tokenizer.encode("Hi <|im_end|>", True)
    assert body["tokens"][-1] == 257  # a special token written in the text is matched whole
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == [gateway.tokenizer.id_to_piece(t) for t in body["tokens"]]
    # `model` is optional (lm-eval's remote tokenizer sends none), token_strs null unless asked
    r = _post(gateway, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})
    assert r.json() == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": [ord("H"), ord("i")],
                        "token_strs": None}


def test_tokenize_messages_renders_the_chat_template(gateway):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    for generation_prompt in (True, False):
        r = _post(gateway, "/tokenize", {"model": MODEL, "messages": messages,
                                         "add_generation_prompt": generation_prompt})
        assert r.status_code == 200, r.text
        text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello?<|im_end|>\n"
        if generation_prompt:
            text += "<|im_start|>assistant\n"
        assert r.json()["tokens"] == gateway.tokenizer.encode(text)


def test_tokenize_then_detokenize_gives_the_text_back(gateway):
    text = "<|im_start|>user\nnaïve café ☕ — ok<|im_end|>"
    tokens = _post(gateway, "/tokenize", {"prompt": text}).json()["tokens"]
    r = _post(gateway, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


def test_tokenizer_info_has_what_lm_evals_remote_tokenizer_reads(gateway):
    r = httpx.get(_root(gateway) + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] is None
    assert info["chat_template"] == CHATML and info["model_max_length"] == MAX_MODEL_LEN
    # lm-eval finds the EOS id by tokenizing the EOS text without special tokens
    eos = _post(gateway, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [257]


def test_tokenizer_endpoints_refuse_bad_input_saying_what_to_fix(gateway):
    msg = _error(_post(gateway, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model")
    assert "`nope` does not exist" in msg and MODEL in msg
    assert "missing" in _error(_post(gateway, "/tokenize", {"model": MODEL}), 400, "prompt")
    msg = _error(_post(gateway, "/tokenize", {"prompt": "x", "add_bos": True}), 400, "add_bos")
    assert "unknown parameter 'add_bos'" in msg and "add_special_tokens" in msg
    msg = _error(_post(gateway, "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}), 400,
                 "messages[0].role")
    assert "'robot' is not supported" in msg
    _error(_post(gateway, "/tokenize", {"prompt": 5}), 400, "prompt")
    msg = _error(_post(gateway, "/detokenize", {"tokens": [1, 99999]}), 400, "tokens[1]")
    assert "outside the vocabulary (0..257)" in msg
    _error(_post(gateway, "/detokenize", {"model": "nope", "tokens": [1]}), 404, "model")
    r = httpx.post(_root(gateway) + "/detokenize", content=b"{not json", timeout=30)
    assert "not valid JSON" in _error(r, 400)


# --- /v1/embeddings ------------------------------------------------------------------------------

TEXTS = ["The cat sat on the mat.", "A volcano erupted in Iceland.", "ok"]


def test_embedding_model_is_listed_as_such(embedding_gateway):
    client = openai.OpenAI(base_url=embedding_gateway.base_url, api_key="unused", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert models[MODEL].kind == "generation"
    assert models[NAME].kind == "embedding" and models[NAME].dimensions == 384
    assert models[NAME].max_model_len == 256
    assert client.models.retrieve(NAME).kind == "embedding"


def test_embeddings_equal_the_embedding_models_output(embedding_gateway, reference):
    client = openai.OpenAI(base_url=embedding_gateway.base_url, api_key="unused", max_retries=0)
    want = reference.embed(TEXTS)
    got = client.embeddings.create(model=NAME, input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == NAME
    np.testing.assert_array_equal(np.array([d.embedding for d in got.data], dtype=np.float32), want)
    counts = reference.token_counts(TEXTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(counts)
    r = _post(embedding_gateway, "/v1/embeddings", {"model": NAME, "input": TEXTS[1],
                                                   "encoding_format": "float", "dimensions": 384})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    # One text alone, against the model on that text alone (a batch pads, and padding may change
    # the matmul kernels' summation order: ~1e-7 apart on some machines).
    np.testing.assert_array_equal(np.array(body["data"][0]["embedding"], dtype=np.float32),
                                  reference.embed([TEXTS[1]])[0])


def test_embeddings_refuse_bad_input_saying_what_to_fix(embedding_gateway):
    h = embedding_gateway
    msg = _error(_post(h, "/v1/embeddings", {"model": NAME, "input": "x", "dimensions": 128}), 400, "dimensions")
    assert "384-dimensional" in msg and "leave dimensions unset" in msg
    msg = _error(_post(h, "/v1/embeddings", {"model": MODEL, "input": "x"}), 404, "model")
    assert f"serves `{NAME}`" in msg
    msg = _error(_post(h, "/v1/embeddings", {"model": NAME, "input": ["a", ""]}), 400, "input[1]")
    assert "empty string" in msg
    assert "send text" in _error(_post(h, "/v1/embeddings", {"model": NAME, "input": [1, 2]}), 400, "input")
    assert "empty list" in _error(_post(h, "/v1/embeddings", {"model": NAME, "input": []}), 400, "input")
    msg = _error(_post(h, "/v1/embeddings", {"model": NAME, "input": ["ok", "word " * 300]}), 400, "input")
    assert msg.startswith("input[1] has 302 tokens") and "reads at most 256" in msg, msg
    msg = _error(_post(h, "/v1/embeddings", {"model": NAME, "input": "x", "encoding_format": "hex"}), 400,
                 "encoding_format")
    assert "'float' or 'base64'" in msg
    assert "missing" in _error(_post(h, "/v1/embeddings", {"model": NAME}), 400, "input")


def test_without_a_kv_service_there_is_no_embedding_model(gateway):
    ids = [m["id"] for m in httpx.get(gateway.base_url + "/models", timeout=30).json()["data"]]
    assert NAME not in ids
    msg = _error(_post(gateway, "/v1/embeddings", {"model": NAME, "input": "x"}), 404, "model")
    assert "--kvcache-address" in msg


# --- keys, /version, /docs --------------------------------------------------------------------

def test_keys_guard_the_new_endpoints_as_the_other_v1_ones(keyed_gateway, keys_and_file):
    keys, _ = keys_and_file
    for method, path, body in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                               ("GET", "/tokenizer_info", None), ("POST", "/v1/embeddings", {"model": NAME, "input": "x"})):
        r = httpx.request(method, _root(keyed_gateway) + path, json=body, timeout=30)
        assert "no API key given" in _error(r, 401), path
        r = httpx.request(method, _root(keyed_gateway) + path, json=body, timeout=30,
                          headers={"Authorization": f"Bearer {keys['acme']}"})
        assert r.status_code != 401, (path, r.text)
    assert _post(keyed_gateway, "/tokenize", {"prompt": "x"}, keys["acme"]).json()["count"] == 1
    assert httpx.get(_root(keyed_gateway) + "/version", timeout=30).json() == {"version": __version__}


def test_docs_serve_the_published_openapi_document(gateway):
    page = httpx.get(_root(gateway) + "/docs", timeout=30)
    assert page.status_code == 200 and "swagger" in page.text.lower() and "/openapi.json" in page.text
    paths = httpx.get(_root(gateway) + "/openapi.json", timeout=30).json()["paths"]
    for path in ("/tokenize", "/detokenize", "/tokenizer_info", "/v1/embeddings", "/version",
                 "/v1/chat/completions"):
        assert path in paths


# --- the same through the gRPC API (kvmesh.gateway.v1.GatewayService) ----------------------------

async def _grpc(h: GatewayHarness, rpc: str, request, key: str | None = None):
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    async with grpc.aio.insecure_channel(h.grpc_address) as channel:
        return await getattr(gateway_pb2_grpc.GatewayServiceStub(channel), rpc)(request, metadata=metadata)


async def _grpc_error(h: GatewayHarness, rpc: str, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _grpc(h, rpc, request)
    return e.value


async def test_grpc_tokenize_and_detokenize_answer_as_the_http_endpoints(gateway):
    text = "<|im_start|>user\nnaïve café ☕ — ok<|im_end|>"
    for body, request in (
            ({"model": MODEL, "prompt": text, "return_token_strs": True},
             gpb.TokenizeRequest(model=MODEL, prompt=text, return_token_strs=True)),
            ({"prompt": "Hi", "add_special_tokens": False}, gpb.TokenizeRequest(prompt="Hi", add_special_tokens=False)),
            ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}],
              "add_generation_prompt": False},
             gpb.TokenizeRequest(messages=[gpb.ChatMessage(role=gpb.ROLE_SYSTEM, content="Be brief."),
                                           gpb.ChatMessage(role=gpb.ROLE_USER, content="Hello?")],
                                 add_generation_prompt=False))):
        want = _post(gateway, "/tokenize", body).json()
        got = await _grpc(gateway, "Tokenize", request)
        assert (list(got.tokens), got.count, got.max_model_len) == (want["tokens"], want["count"], want["max_model_len"])
        assert list(got.token_strs) == (want["token_strs"] or [])
    tokens = (await _grpc(gateway, "Tokenize", gpb.TokenizeRequest(prompt=text))).tokens
    got = await _grpc(gateway, "Detokenize", gpb.DetokenizeRequest(model=MODEL, tokens=tokens))
    assert got.prompt == _post(gateway, "/detokenize", {"tokens": list(tokens)}).json()["prompt"] == text
    info = httpx.get(_root(gateway) + "/tokenizer_info", timeout=30).json()
    got = await _grpc(gateway, "GetTokenizerInfo", gpb.GetTokenizerInfoRequest())
    assert {f.name: v for f, v in got.ListFields()} == {k: v for k, v in info.items() if v not in (None, False)}


async def test_grpc_tokenizer_errors_carry_the_http_messages(gateway):
    for path, body, rpc, request, code in (
            ("/tokenize", {"model": "nope", "prompt": "x"}, "Tokenize", gpb.TokenizeRequest(model="nope", prompt="x"),
             grpc.StatusCode.NOT_FOUND),
            ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "Tokenize",
             gpb.TokenizeRequest(messages=[gpb.ChatMessage(role=gpb.ROLE_TOOL, content="x")]),
             grpc.StatusCode.INVALID_ARGUMENT),
            ("/detokenize", {"tokens": [1, 99999]}, "Detokenize", gpb.DetokenizeRequest(tokens=[1, 99999]),
             grpc.StatusCode.INVALID_ARGUMENT)):
        message = _post(gateway, path, body).json()["error"]["message"]
        e = await _grpc_error(gateway, rpc, request)
        assert (e.code(), e.details()) == (code, message)
    e = await _grpc_error(gateway, "Tokenize", gpb.TokenizeRequest(prompt="x", messages=[
        gpb.ChatMessage(role=gpb.ROLE_USER, content="y")]))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in e.details()


async def test_grpc_embed_equals_the_http_embeddings(embedding_gateway, reference):
    h = embedding_gateway
    body = _post(h, "/v1/embeddings", {"model": NAME, "input": TEXTS, "encoding_format": "float"}).json()
    got = await _grpc(h, "Embed", gpb.EmbedRequest(model=NAME, input=TEXTS))
    assert got.model == NAME and got.id.startswith("embd-")
    vectors = np.array([list(e.values) for e in got.embeddings], dtype=np.float32)
    np.testing.assert_array_equal(vectors, np.array([d["embedding"] for d in body["data"]], dtype=np.float32))
    np.testing.assert_array_equal(vectors, reference.embed(TEXTS))
    assert (got.usage.prompt_tokens, got.usage.total_tokens) == (body["usage"]["prompt_tokens"],
                                                                 body["usage"]["total_tokens"])
    models = {m.id: m for m in (await _grpc(h, "ListModels", gpb.ListModelsRequest())).models}
    assert models[MODEL].kind == gpb.MODEL_KIND_GENERATION
    assert (models[NAME].kind, models[NAME].dimensions, models[NAME].max_model_len) == (
        gpb.MODEL_KIND_EMBEDDING, 384, 256)


async def test_grpc_embed_errors_carry_the_http_messages(embedding_gateway, gateway):
    for h, body, request, code in (
            (embedding_gateway, {"model": NAME, "input": ["x"], "dimensions": 128},
             gpb.EmbedRequest(model=NAME, input=["x"], dimensions=128), grpc.StatusCode.INVALID_ARGUMENT),
            (embedding_gateway, {"model": NAME, "input": ["a", ""]}, gpb.EmbedRequest(model=NAME, input=["a", ""]),
             grpc.StatusCode.INVALID_ARGUMENT),
            (embedding_gateway, {"model": NAME, "input": []}, gpb.EmbedRequest(model=NAME),
             grpc.StatusCode.INVALID_ARGUMENT),
            (embedding_gateway, {"model": MODEL, "input": ["x"]}, gpb.EmbedRequest(model=MODEL, input=["x"]),
             grpc.StatusCode.NOT_FOUND),
            (gateway, {"model": NAME, "input": ["x"]}, gpb.EmbedRequest(model=NAME, input=["x"]),
             grpc.StatusCode.NOT_FOUND)):
        message = _post(h, "/v1/embeddings", body).json()["error"]["message"]
        e = await _grpc_error(h, "Embed", request)
        assert (e.code(), e.details()) == (code, message)
    assert NAME not in [m.id for m in (await _grpc(gateway, "ListModels", gpb.ListModelsRequest())).models]


async def test_grpc_keys_guard_the_new_rpcs_and_version_needs_none(keyed_gateway, keys_and_file):
    keys, _ = keys_and_file
    for rpc, request in (("Tokenize", gpb.TokenizeRequest(prompt="x")), ("Detokenize", gpb.DetokenizeRequest()),
                         ("GetTokenizerInfo", gpb.GetTokenizerInfoRequest()),
                         ("Embed", gpb.EmbedRequest(model=NAME, input=["x"]))):
        assert (await _grpc_error(keyed_gateway, rpc, request)).code() == grpc.StatusCode.UNAUTHENTICATED
    assert (await _grpc(keyed_gateway, "Tokenize", gpb.TokenizeRequest(prompt="x"), keys["acme"])).count == 1
    assert (await _grpc(keyed_gateway, "GetVersion", gpb.GetVersionRequest())).version == __version__
