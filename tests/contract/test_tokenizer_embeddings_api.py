"""The gateway's vLLM-shaped extras: POST /tokenize, POST /detokenize, GET /tokenizer_info,
POST /v1/embeddings (the KV service's real all-MiniLM-L6-v2, behind a real KV-cache server),
GET /version and GET /docs — shapes, status codes, and errors that say what to fix."""
from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import openai
import pytest

from gateway_utils import CHATML, MAX_MODEL_LEN, MODEL, GatewayHarness
from kvcache_utils import serving
from kvmesh import __version__
from kvmesh.embed import NAME, Embedder
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
    np.testing.assert_array_equal(np.array(body["data"][0]["embedding"], dtype=np.float32), want[1])


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
