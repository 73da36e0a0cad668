"""The whole stack as processes on loopback (KV service, engine, router, gateway — what `kvmesh up`
starts), on the real SmolLM2 model, called with the real `openai` SDK: sync and async clients,
streaming and not, chat and completions; and a client that disconnects mid-stream frees the
engine's slot promptly."""
from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest

from kvmesh import launcher
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("stack")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_DATA_DIR", str(data))
    ports = launcher.StackPorts(http=launcher.free_port(), gateway=launcher.free_port(),
                                router=launcher.free_port(), engine=launcher.free_port(),
                                kvcache=launcher.free_port(), draft=launcher.free_port())
    procs = launcher.up(launcher.StackPlan(ports=ports, engine_args=("--kv-cache-bytes", str(64 << 20))))
    try:
        yield {p.name: p for p in procs}
    finally:
        launcher.down()
        mp.undo()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack["gateway"].url, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    [model] = [m for m in client.models.list().data if m.id == MODEL]
    extra = model.model_extra
    assert extra["root"] == MODEL and extra["max_model_len"] == 8192


def test_chat_non_streaming_answers_and_reuses_the_prompt_the_second_time(client):
    messages = [{"role": "system", "content": "You are a geography tutor. " * 8},
                {"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert "Paris" in first.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    assert first.usage.prompt_tokens > 64 and 0 < first.usage.completion_tokens <= 12
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    # the engine's prefix cache holds the first request's whole blocks, and the response says the
    # hit was exact (the OpenAI SDK keeps the kvmesh extension object as an extra field)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    reuse = again.model_extra["kvmesh"]["reuse"]
    assert reuse["exact"] and reuse["storage"] == "exact"
    assert reuse["prefix_cache_tokens"] + reuse["kv_service_tokens"] == again.usage.prompt_tokens_details.cached_tokens


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=10,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 10


def test_completions_echo_with_prompt_logprobs_and_stop(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                    temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text.startswith("The capital of France is")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None                 # the first prompt token has no context
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                        stop=[" 7"])
    assert " 7" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_async_client_streams_completions_and_n_choices(stack):
    async def run():
        client = openai.AsyncOpenAI(base_url=stack["gateway"].url, api_key="unused", max_retries=0, timeout=120)
        stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                                 temperature=0, stream=True)
        pieces = [c.choices[0].text async for c in stream]
        many = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say a word."}], max_tokens=6, n=2, seed=7,
            temperature=1.0)
        await client.close()
        return pieces, many

    pieces, many = asyncio.run(run())
    assert "".join(pieces).strip()
    assert sorted(c.index for c in many.choices) == [0, 1]
    assert all(c.message.content for c in many.choices)
    assert 2 <= many.usage.completion_tokens <= 12    # both choices' tokens, 6 each at most


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=100_000)
    assert "context" in str(err.value).lower()


def _engine_load(address: str) -> engine_pb2.ProbeResponse:
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineServiceStub(ch).Probe(
            engine_pb2.ProbeRequest(token_ids=common_pb2.TokenIds(ids=[1])), timeout=5)


def test_client_disconnect_frees_the_engine_slot_promptly(stack, client):
    engine = stack["engine"].address
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 500, one number per line."}],
        max_tokens=1000, temperature=0, stream=True)
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    assert _engine_load(engine).running == 1        # still generating when the client leaves
    closed = time.monotonic()
    stream.close()
    # Measured: the time until the engine reports no running or waiting request. Polled, since
    # the engine's slot is what we measure; the bound is generous for a loaded 2-core machine.
    while True:
        load = _engine_load(engine)
        if load.running == 0 and load.waiting == 0:
            break
        assert time.monotonic() - closed < 5.0, f"engine still busy 5 s after the client left: {load}"
        time.sleep(0.02)
    freed_after = time.monotonic() - closed
    print(f"engine slot freed {freed_after * 1000:.0f} ms after the client disconnected")
    assert freed_after < 5.0


def test_documents_catalogued_cited_retrieved_and_blended(stack, client, tmp_path, capsys):
    """The catalog from the command line (ingest through the engine, list/search/rm in the KV
    service), then chat requests that cite a document by id, retrieve by question, or carry
    documents inline: computed in place by default, blended in when the request opts in, and the
    response says which documents and how many tokens were reused."""
    from kvmesh import cli

    where = ["--engine", stack["engine"].address, "--kvcache", stack["kvcache"].address]
    docs = {"volcano": "Volcanoes form where molten rock from deep inside the Earth reaches the surface. "
                       "Lava, ash and gas erupt through vents; the island of Iceland sits on such a hot spot. " * 3,
            "bread": "Bread is made by mixing flour, water, salt and yeast, letting the dough rise, and "
                     "baking it in a hot oven until the crust turns golden brown. " * 3}
    for doc_id, text in docs.items():
        path = tmp_path / f"{doc_id}.txt"
        path.write_text(text)
        assert cli.main(["docs", "add", doc_id, str(path), "--meta", "topic=test", *where]) == 0
    assert cli.main(["docs", "list", *where]) == 0
    listed = capsys.readouterr().out
    assert "volcano" in listed and "bread" in listed and "topic=test" in listed
    assert cli.main(["docs", "search", "how is dough baked", "-k", "1", *where]) == 0
    assert capsys.readouterr().out.split()[-1] == "bread"

    ask = [{"role": "user", "content": "What erupts through the vents?"}]
    cited = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                           extra_body={"documents": [{"id": "volcano"}], "recompute_ratio": 0.15})
    report = cited.model_extra["kvmesh"]
    assert report["document_ids"] == ["volcano"] and report["blended_tokens"] > 50
    found = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                           extra_body={"retrieve": {"top_k": 1}})
    assert found.model_extra["kvmesh"]["document_ids"] == ["volcano"]

    inline = [{"text": docs["bread"]}, {"text": "A short note about rivers and the sea. " * 8}]
    blend = {"lossy": {"recompute_ratio": 0.15, "max_kl": 0.5}}  # the kvmesh extension's opt-in
    first = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0,
                                           extra_body={"documents": inline, "kvmesh": blend})
    assert first.model_extra["kvmesh"]["blended_tokens"] > 0  # "bread" was ingested: found by content
    assert first.model_extra["kvmesh"]["reuse"]["storage"].startswith("blend:")
    assert not first.model_extra["kvmesh"]["reuse"]["exact"]
    # The first request stores the rivers note on the engine's export thread, after its answer:
    # ask again until that store has landed (each answer is the observation; no sleeping).
    for _ in range(30):
        swapped = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0,
                                                 extra_body={"documents": inline[::-1], "kvmesh": blend})
        both = swapped.model_extra["kvmesh"]["blended_tokens"]
        if both > first.model_extra["kvmesh"]["blended_tokens"]:
            break
    assert both > first.model_extra["kvmesh"]["blended_tokens"]  # the rivers note was stored by the first
    exact = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0,
                                           extra_body={"documents": inline[::-1]})
    report = exact.model_extra["kvmesh"]  # no opt-in: both documents are cached, and computed in place
    assert report["blended_tokens"] == 0 and report.get("reuse", {"exact": True})["exact"]

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                       extra_body={"documents": [{"id": "no-such-document"}]})
    assert cli.main(["docs", "rm", "bread", *where]) == 0
    assert capsys.readouterr().out.startswith("bread: deleted")
    assert cli.main(["docs", "list", *where]) == 0
    assert "bread" not in capsys.readouterr().out
