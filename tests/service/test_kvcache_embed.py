"""KvCatalogService.Embed and GetEmbeddingModel over gRPC (the gateway's /v1/embeddings), with the
WordEmbedder stand-in: vectors and token counts as the embedder gives them, and refusals that name
the text to fix."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvcache_utils import WordEmbedder, serving
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.limits import MAX_EMBED_TEXTS

from test_kvcache_service import config


async def test_embed_returns_the_embedders_vectors_and_token_counts(tmp_path):
    embedder = WordEmbedder()
    async with serving(config(tmp_path), embedder=embedder) as s:
        texts = ["the cat sat", "stock prices fell on monday"]
        r = await s.catalog.Embed(pb.EmbedRequest(texts=texts))
        np.testing.assert_array_equal(np.array([e.values for e in r.embeddings], dtype=np.float32),
                                      WordEmbedder().embed(texts))
        assert list(r.token_counts) == [3, 5] and r.model == "word-embedder"
        info = await s.catalog.GetEmbeddingModel(pb.GetEmbeddingModelRequest())
        assert (info.name, info.dimensions, info.max_tokens) == ("word-embedder", 384, 64)


@pytest.mark.parametrize("texts, message", [
    ([], f"send 1..{MAX_EMBED_TEXTS} texts, got 0"),
    (["ok", ""], "text 1 is empty"),
    (["ok", "word " * 65], "text 1 has 65 tokens, but the embedding model word-embedder reads at most 64"),
])
async def test_embed_refuses_what_it_cannot_embed_whole(tmp_path, texts, message):
    embedder = WordEmbedder()
    async with serving(config(tmp_path), embedder=embedder) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.catalog.Embed(pb.EmbedRequest(texts=texts))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()
        assert embedder.calls == 0  # refused before any embedding
