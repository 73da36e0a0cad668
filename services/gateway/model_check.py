"""The gateway's start-up check that it tokenizes like the engines behind the router.

The gateway turns text into token ids itself; an engine given those ids never sees the text. If
the gateway read another model's tokenizer (a forgotten ``--model``), every answer would be
silently wrong. So before serving, the gateway asks the router for its tiers (the router takes
each from its engines' GetModelInfo) and compares every tier's tokenizer fingerprint with its own:
any mismatch refuses the start, naming both models. Tiers that report none (OpenAI-compatible
upstreams, engines without a tokenizer) are not checked; a router that does not answer in time is
logged and the gateway starts (the router may come later, as in a container stack).
"""
from __future__ import annotations

import logging

import grpc

from kvmesh.config import ConfigError
from kvmesh.model.tokenizer import Tokenizer
from kvmesh.router.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


def mismatches(tokenizer: Tokenizer, source: str, cards: list[router_pb2.ModelCard]) -> list[str]:
    """One line per tier whose engines tokenize differently from `tokenizer` (read from `source`)."""
    mine = tokenizer.fingerprint()
    return [f"tier {c.id!r} serves model {c.root!r} (engine --model {c.model_source or '?'}), whose tokenizer "
            f"differs from the gateway's (--model {source})"
            for c in cards if c.kind == router_pb2.MODEL_KIND_TIER and c.tokenizer_fingerprint
            and c.tokenizer_fingerprint != mine]


async def check_upstream_tokenizer(channel: grpc.aio.Channel, tokenizer: Tokenizer, source: str,
                                   timeout_s: float) -> int:
    """Raise ConfigError when a tier's engines tokenize differently from the gateway (see the
    module docstring); returns how many tiers were checked. `timeout_s` 0 skips the check."""
    if timeout_s <= 0:
        return 0
    try:
        response = await router_pb2_grpc.RouterServiceStub(channel).ListModels(
            router_pb2.ListModelsRequest(), timeout=timeout_s, wait_for_ready=True)
    except grpc.aio.AioRpcError as e:
        log.warning("could not check the engines' tokenizer against the gateway's (router: %s %s); "
                    "starting unchecked", e.code().name, e.details())
        return 0
    cards = list(response.models)
    wrong = mismatches(tokenizer, source, cards)
    if wrong:
        sources = sorted({c.model_source for c in cards if c.model_source})
        raise ConfigError("the gateway would tokenize prompts for another model than the engines serve: "
                          + "; ".join(wrong) + ". Start the gateway with the engines' model: --model "
                          + (" or ".join(sources) or "the engines' --model")
                          + " (KVMESH_GATEWAY_MODEL)")
    checked = sum(1 for c in cards if c.kind == router_pb2.MODEL_KIND_TIER and c.tokenizer_fingerprint)
    log.info("tokenizer matches the engines of %d tier(s)", checked)
    return checked
