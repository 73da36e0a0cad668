"""The gateway's start-up check against the engines' tokenizer (services/gateway/model_check.py),
with a fake router on a real port: a tier whose engines report another tokenizer refuses the
start naming both models; the same tokenizer, tiers without one, and a router that is down do not."""
from __future__ import annotations

import grpc
import pytest

from gateway_utils import ROUTER_SERVICE, FakeRouter, tiny_tokenizer
from kvmesh.config import ConfigError
from kvmesh.model.tokenizer import Tokenizer
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.services.gateway.model_check import check_upstream_tokenizer
from model_families import tokenizer_metadata
from rpc_utils import served


def _card(name: str, fingerprint: str, source: str = "/models/x") -> router_pb2.ModelCard:
    return router_pb2.ModelCard(id=name, root=f"{name}-root", kind=router_pb2.MODEL_KIND_TIER, tiers=[name],
                                tokenizer_fingerprint=fingerprint, model_source=source)


async def _check(cards, tokenizer, source="gateway-model", timeout_s=5.0):
    fake = FakeRouter(tokenizer)
    fake.state.models = cards
    async with served("router", lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(fake, s),
                      ROUTER_SERVICE) as srv:
        return await check_upstream_tokenizer(srv.channel, tokenizer, source, timeout_s)


async def test_same_tokenizer_passes_and_unreported_tiers_are_skipped():
    tok = tiny_tokenizer()
    cards = [_card("a", tok.fingerprint()), _card("b", ""),
             router_pb2.ModelCard(id="auto", kind=router_pb2.MODEL_KIND_CASCADE, tiers=["a", "b"])]
    assert await _check(cards, tok) == 1


async def test_another_models_tokenizer_refuses_the_start_naming_both():
    mine = tiny_tokenizer()
    theirs = Tokenizer.from_gguf_metadata(tokenizer_metadata("qwen2"))
    cards = [_card("a", mine.fingerprint()), _card("qwen", theirs.fingerprint(), "/models/tiny-qwen2")]
    with pytest.raises(ConfigError, match=r"tier 'qwen' serves model 'qwen-root' \(engine --model "
                                          r"/models/tiny-qwen2\).*--model bundled\).*--model /models/tiny-qwen2"):
        await _check(cards, mine, source="bundled")


async def test_a_chat_template_override_is_not_a_mismatch():
    tok = tiny_tokenizer()
    other_template = tok.with_chat_template("{{ messages[0]['content'] }}")
    assert await _check([_card("a", tok.fingerprint())], other_template) == 1


async def test_router_down_starts_unchecked_and_zero_timeout_skips():
    tok = tiny_tokenizer()
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:  # nothing listens there
        assert await check_upstream_tokenizer(channel, tok, "m", timeout_s=0.2) == 0
        assert await check_upstream_tokenizer(channel, tok, "m", timeout_s=0) == 0
