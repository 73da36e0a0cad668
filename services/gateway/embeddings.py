"""POST /v1/embeddings: OpenAI's embeddings API over the KV service's sentence-embedding model.

The KV service already runs all-MiniLM-L6-v2 for its semantic index (kvmesh.embed), loaded once
in that process; the gateway asks it through KvCatalogService.Embed rather than loading a second
copy. So the endpoint exists when the gateway is given `--kvcache-address` (`kvmesh up` does);
without it, or while the KV service cannot be reached, the model is simply not listed in
/v1/models, and a request naming it gets 404 (not configured) or 503 (unreachable).

Body: `{"model", "input": str | [str, ...], "encoding_format": "float" | "base64",
"dimensions"?, "user"?}`; unknown fields are refused. Texts are never truncated: one longer than
the model reads is a 400 that says so. `dimensions` other than the model's own width is a 400
(all-MiniLM-L6-v2 is not a Matryoshka model: cutting its vectors would degrade them). Token-id
input is refused: ids of the generation model mean nothing to the embedding model. base64 is
the little-endian float32 bytes of each vector, as OpenAI's SDKs decode it. The gRPC API's Embed
answers through the same `Embeddings.embed`.
"""
from __future__ import annotations

import base64
import logging
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from kvmesh.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc
from kvmesh.limits import MAX_EMBED_TEXTS
from kvmesh.rpc.client import make_channel
from kvmesh.services.gateway.errors import ApiError, invalid, to_api_error
from kvmesh.services.gateway.tokenization import StrictBody, decode_body

log = logging.getLogger(__name__)

_INFO_TIMEOUT_S = 2.0


class EmbeddingsBody(StrictBody):
    """POST /v1/embeddings."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


@dataclass(frozen=True)
class EmbeddingModel:
    """The KV service's embedding model, as /v1/models lists it."""

    name: str
    dimensions: int
    max_tokens: int
    created: int


@dataclass(frozen=True)
class Embedded:
    """A request's embeddings, as both front ends answer them."""

    id: str
    created: int
    model: str
    vectors: list[Sequence[float]]
    """One per input text, in order."""
    tokens: int
    """The embedding model's tokens over all texts."""


def require(embeddings: Embeddings | None) -> Embeddings:
    """`embeddings`, or the 404 of a gateway that serves no embedding model."""
    if embeddings is None:
        raise ApiError(grpc.StatusCode.NOT_FOUND, "this gateway serves no embedding model; start "
                       "it with --kvcache-address (the KV service computes embeddings), as "
                       "`kvmesh up` does", param="model", error_code="model_not_found")
    return embeddings


class Embeddings:
    """The KV service's embedding model seen from the gateway (one channel, closed by `close`)."""

    def __init__(self, address: str, timeout_s: float, retry_after_s: int) -> None:
        self.address = address
        self._channel = make_channel(address)
        self._stub = kvcache_pb2_grpc.KvCatalogServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._model: EmbeddingModel | None = None

    async def close(self) -> None:
        await self._channel.close()

    async def model(self) -> EmbeddingModel:
        """The model's description (asked once, then kept: it cannot change while the KV service
        runs); a 503 ApiError when the KV service does not answer."""
        if self._model is None:
            try:
                info = await self._stub.GetEmbeddingModel(kvcache_pb2.GetEmbeddingModelRequest(),
                                                          timeout=_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                raise self._unavailable(e) from e
            self._model = EmbeddingModel(info.name, info.dimensions, info.max_tokens, int(time.time()))
        return self._model

    async def listed(self) -> EmbeddingModel | None:
        """The model for /v1/models, or None (logged) while the KV service cannot be reached."""
        try:
            return await self.model()
        except ApiError as e:
            log.warning("embedding model not listed: %s", e.message)
            return None

    async def create(self, raw: bytes) -> dict[str, Any]:
        """The body of POST /v1/embeddings' answer (raises ApiError)."""
        body = decode_body(raw, EmbeddingsBody)
        out = await self.embed(body.model, body.input, body.dimensions)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(out.vectors)]
        return {"id": out.id, "object": "list", "created": out.created, "model": out.model, "data": data,
                "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens}}

    async def embed(self, model_name: str, texts_input: str | list[str] | list[int] | list[list[int]],
                    dimensions: int | None) -> Embedded:
        """Embeddings of the input texts by the model named `model_name` (raises ApiError: 404
        for another model, 400 for input the model cannot take, 503 while the KV service is
        unreachable)."""
        model = await self.model()
        if model_name != model.name:
            raise ApiError(grpc.StatusCode.NOT_FOUND,
                           f"The model `{model_name}` does not exist or is not an embedding model; "
                           f"/v1/embeddings serves `{model.name}`", param="model",
                           error_code="model_not_found")
        if dimensions is not None and dimensions != model.dimensions:
            raise invalid(f"{model.name} makes {model.dimensions}-dimensional embeddings and cannot "
                          "shorten them (it is not a Matryoshka model); leave dimensions unset",
                          "dimensions", "unsupported_value")
        texts = _texts(texts_input)
        try:
            answer = await self._stub.Embed(kvcache_pb2.EmbedRequest(texts=texts), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.INVALID_ARGUMENT:  # the model's own limit, say
                message = re.sub(r"^Embed: text (\d+)", r"input[\1]", e.details() or "")
                raise invalid(message, "input", "invalid_value") from e
            raise self._unavailable(e) from e
        return Embedded(f"embd-{uuid.uuid4().hex[:24]}", int(time.time()), model.name,
                        [e.values for e in answer.embeddings], sum(answer.token_counts))

    def _unavailable(self, e: grpc.aio.AioRpcError) -> ApiError:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return ApiError(grpc.StatusCode.UNAVAILABLE,
                            f"the KV service ({self.address}), which computes embeddings, is "
                            f"unavailable ({e.details() or e.code().name}); retry shortly",
                            error_code="upstream_unavailable", retry_after=self._retry_after_s)
        return to_api_error(e, retry_after=self._retry_after_s)


def connect(address: str | None, timeout_s: float, retry_after_s: int) -> Embeddings | None:
    """The embeddings endpoint's client for `--kvcache-address`, or None when it is unset."""
    return None if not address else Embeddings(address, timeout_s, retry_after_s)


def _texts(value: str | list[str] | list[int] | list[list[int]]) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise invalid("input is an empty list; send a string or a list of 1.."
                      f"{MAX_EMBED_TEXTS} strings", "input", "invalid_value")
    if not all(isinstance(t, str) for t in texts):
        raise invalid("input holds token ids; send text: the embedding model has its own "
                      "tokenizer, unrelated to the generation model's ids", "input", "invalid_value")
    if len(texts) > MAX_EMBED_TEXTS:
        raise invalid(f"input has {len(texts)} strings; send at most {MAX_EMBED_TEXTS} per request",
                      "input", "invalid_value")
    empty = next((i for i, t in enumerate(texts) if not t), None)
    if empty is not None:
        where = "input" if isinstance(value, str) else f"input[{empty}]"
        raise invalid(f"{where} is an empty string; send at least one character", where, "invalid_value")
    return texts  # type: ignore[return-value]


def _encode(values: Any, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return list(values)
