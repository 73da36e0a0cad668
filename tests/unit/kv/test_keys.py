"""Chunk keys: chained, namespaced, stable across processes."""
import os
import subprocess
import sys

import pytest

from kvmesh.kv.keys import KEY_BYTES, content_key, prefix_keys, tail_key
from kvmesh.kv.namespace import KvLayout, KvNamespace

LAYOUT = KvLayout(30, 3, 64, "float32")
BASE = KvNamespace("weights-sha", LAYOUT)
NS = BASE.digest()


def test_one_key_per_full_chunk_chained_through_the_prefix():
    tokens = list(range(100))
    keys = prefix_keys(tokens, 32, NS)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys) and len(set(keys)) == 3
    assert prefix_keys(tokens[:96], 32, NS) == keys  # the partial tail chunk has no key
    changed_late = prefix_keys(tokens[:40] + [7] + tokens[41:], 32, NS)
    assert changed_late[0] == keys[0] and changed_late[1:] != keys[1:]
    changed_early = prefix_keys([5] + tokens[1:], 32, NS)
    assert all(a != b for a, b in zip(changed_early, keys))  # every later chunk depends on it


@pytest.mark.parametrize("other", [
    KvNamespace("other-weights", LAYOUT).digest(),
    KvNamespace("weights-sha", KvLayout(30, 3, 64, "bfloat16")).digest(),
    KvNamespace("weights-sha", KvLayout(30, 3, 64, "float32", rope="pre-rope-hf theta=500000")).digest(),
    BASE.for_tenant("tenant-b").digest(),
    BASE.with_storage("int4-g64-r0-h0-o0").digest(),
])
def test_namespaces_separate_models_layouts_storage_and_tenants(other):
    tokens = list(range(64))
    assert other != NS
    assert set(prefix_keys(tokens, 32, other)).isdisjoint(prefix_keys(tokens, 32, NS))
    assert content_key(tokens[:32], other) != content_key(tokens[:32], NS)


def test_a_tail_key_names_the_partial_chunk_after_its_prefix():
    tokens = list(range(100))
    tail = tail_key(tokens, 32, NS)
    assert len(tail) == KEY_BYTES and tail not in prefix_keys(tokens, 32, NS)
    assert tail_key(tokens[:96], 32, NS) is None                     # ends on a chunk boundary
    assert tail_key(tokens[:99], 32, NS) != tail                       # another tail
    assert tail_key([5] + tokens[1:], 32, NS) != tail                  # another prefix before it
    assert tail_key(tokens, 32, KvNamespace("x", LAYOUT).digest()) != tail
    assert tail_key(tokens[:10], 32, NS) is not None                   # no full chunk: chained to zeros
    assert tail_key(list(range(96, 128)), 32, NS) != prefix_keys(list(range(96, 128)), 32, NS)[0]


def test_content_key_is_position_free_and_differs_from_prefix_key():
    doc = list(range(1000, 1032))
    assert content_key(doc, NS) == content_key(list(doc), NS)
    first_chunk_key = prefix_keys(doc, 32, NS)[0]
    assert content_key(doc, NS) != first_chunk_key


def test_keys_are_stable_across_processes():
    code = ("from kvmesh.kv.keys import *; from kvmesh.kv.namespace import *;"
            "ns = KvNamespace('weights-sha', KvLayout(30, 3, 64, 'float32')).digest();"
            "print(prefix_keys(list(range(100)), 32, ns)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {prefix_keys(list(range(100)), 32, NS)[-1].hex()}


def test_bad_input_is_rejected_with_a_message():
    with pytest.raises(ValueError, match="chunk_tokens"):
        prefix_keys([1, 2], 0, NS)
    with pytest.raises(ValueError, match="16 bytes"):
        prefix_keys([1, 2], 1, b"short")
    with pytest.raises(ValueError, match="token ids"):
        prefix_keys([-1], 1, NS)


def test_document_chunks_align_to_the_document_not_the_prompt():
    from kvmesh.kv.keys import content_key, document_chunks

    ns = b"n" * 16
    doc = list(range(100, 170))  # 70 tokens: chunks of 32, 32 and 6
    chunks = document_chunks(doc, 32, ns)
    assert [(a, b) for a, b, _ in chunks] == [(0, 32), (32, 64), (64, 70)]
    assert chunks[2][2] == content_key(doc[64:], ns)  # the short tail has a key too
    assert document_chunks([7] * 5 + doc, 32, ns)[0][2] != chunks[0][2]  # other text, other keys
    assert document_chunks(doc, 32, b"m" * 16)[0][2] != chunks[0][2]
    assert document_chunks([], 32, ns) == []
    with pytest.raises(ValueError):
        document_chunks(doc, 0, ns)
