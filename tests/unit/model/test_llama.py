"""LlamaForCausalLM against transformers on a tiny random checkpoint: dense, paged, greedy."""

from __future__ import annotations

import pytest
import torch

from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache, kv_bytes_per_block
from kvmesh.model.loader import load_model

from .conftest import make_tiny_hf
from .paged import PagedRunner, greedy_paged

ATOL = 2e-5  # fp32, logits of magnitude ~10: only reduction-order differences allowed


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_loads_hf_config(tiny):
    lm = load_model(str(tiny.folder))
    c = lm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 64, 4, 2, 16)
    assert (c.rope_theta, c.vocab_size, c.eos_token_ids, c.tie_word_embeddings) == (5000.0, 128, (2,), False)
    assert lm.tokenizer is None and lm.weights == "fp32" and len(lm.weights_digest) == 64
    assert not any(p.requires_grad for p in lm.model.parameters())


@pytest.mark.parametrize("tie", [False, True])
def test_dense_logits_match_hf(tmp_path, tie):
    ck = make_tiny_hf(tmp_path, tie=tie, seed=1)
    model = load_model(str(tmp_path)).model
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (3, 41))
    with torch.no_grad():
        want = ck.hf_model(ids).logits.float()
    got = model.forward_dense(ids)
    assert got.dtype == torch.float32 and got.shape == (3, 41, 128)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_paged_chunked_prefill_and_decode_match_hf(tiny):
    """Two sequences in one batch, uneven prefill chunks, a mixed prefill+decode step, then decodes."""
    model = load_model(str(tiny.folder)).model
    torch.manual_seed(1)
    seqs = [torch.randint(0, 128, (46,)).tolist(), torch.randint(0, 128, (31,)).tolist()]
    # (seq -> number of new tokens) per step; runs both sequences to their full length
    schedule = [{0: 5, 1: 9}, {0: 17, 1: 1}, {0: 11, 1: 13}, {0: 1, 1: 1}, {0: 1}, {0: 3, 1: 1},
                {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1, 1: 1}, {0: 1}, {0: 1}]
    assert [sum(s.get(i, 0) for s in schedule) for i in (0, 1)] == [46, 31]
    want = [_hf_logits(tiny.hf_model, s) for s in seqs]
    runner = PagedRunner(model, 2, block_size=4, max_blocks=16)
    done = [0, 0]
    for step in schedule:
        chunks = {s: seqs[s][done[s]:done[s] + n] for s, n in step.items()}
        for s, logits in runner.step(chunks).items():
            n = len(chunks[s])
            torch.testing.assert_close(logits, want[s][done[s]:done[s] + n], atol=ATOL, rtol=0)
            done[s] += n


def test_decode_batch_with_uneven_contexts(tiny):
    """Pure decode steps (the batched SDPA path) with contexts of different lengths and padding."""
    model = load_model(str(tiny.folder)).model
    torch.manual_seed(2)
    lens = [3, 17, 8, 1, 25]
    seqs = [torch.randint(0, 128, (n + 4,)).tolist() for n in lens]
    runner = PagedRunner(model, len(seqs), block_size=8, max_blocks=8, num_blocks=64)
    runner.step({s: seq[:n] for s, (seq, n) in enumerate(zip(seqs, lens))})
    for k in range(4):
        out = runner.step({s: [seq[lens[s] + k]] for s, seq in enumerate(seqs)})
        for s, seq in enumerate(seqs):
            want = _hf_logits(tiny.hf_model, seq[: lens[s] + k + 1])[-1]
            torch.testing.assert_close(out[s][0], want, atol=ATOL, rtol=0)


def test_greedy_generation_matches_hf(tiny):
    model = load_model(str(tiny.folder)).model
    torch.manual_seed(3)
    prompts = [torch.randint(3, 128, (19,)).tolist(), torch.randint(3, 128, (6,)).tolist()]
    ours = greedy_paged(model, prompts, max_new=24, prefill_chunk=5)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            out = tiny.hf_model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
        assert got == out[0, len(p):].tolist()


def test_bfloat16_paged_matches_dense(tiny):
    model = load_model(str(tiny.folder), dtype="bfloat16").model
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    torch.manual_seed(4)
    seq = torch.randint(0, 128, (21,)).tolist()
    dense = model.forward_dense(torch.tensor([seq]))[0]
    runner = PagedRunner(model, 1)
    paged = torch.cat([runner.step({0: seq[:13]})[0]] + [runner.step({0: [t]})[0] for t in seq[13:]])
    assert paged.dtype == torch.float32
    ref = _hf_logits(tiny.hf_model, seq)
    assert (paged - dense).abs().max() < 0.1 * ref.abs().max()
    assert (paged - ref).abs().max() < 0.1 * ref.abs().max()


def test_kv_cache_layout(tiny):
    lm = load_model(str(tiny.folder))
    kv = allocate_kv_cache(lm.config, num_blocks=5, block_size=4, dtype=torch.bfloat16, device="cpu")
    assert len(kv) == 2 and kv[0][0].shape == (5, 4, 2, 16) and kv[0][1].dtype == torch.bfloat16
    assert kv_bytes_per_block(lm.config, 4, torch.bfloat16) == 2 * 2 * 4 * 2 * 16 * 2
    # The first token written by a step lands exactly in its slot, keys rotated, values raw.
    runner = PagedRunner(lm.model, 1, block_size=4)
    runner.kv = kv = allocate_kv_cache(lm.config, 96, 4, torch.float32, "cpu")
    runner.step({0: [5, 6, 7, 8, 9]})
    slot = int(runner.tables[0, 1]) * 4 + 0  # token 4 -> second block, offset 0
    assert kv[0][1].view(-1, 2, 16)[slot].abs().sum() > 0
    assert kv[0][1].view(-1, 2, 16)[slot + 1].abs().sum() == 0


def test_metadata_validation():
    bt = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="sum"):
        AttentionMetadata.build(torch.zeros(3, dtype=torch.long), [1, 1], [1, 1], bt, 4)
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build(torch.zeros(3, dtype=torch.long), [2, 1], [1, 1], bt, 4)
    with pytest.raises(ValueError, match="too narrow"):
        AttentionMetadata.build(torch.zeros(2, dtype=torch.long), [1, 1], [17, 1], bt, 4)
    meta = AttentionMetadata.build(torch.zeros(2, dtype=torch.long), [1, 1], [5, 9], bt, 4)
    assert meta.all_decode and meta.decode_mask.shape == (2, 1, 1, 12)
    assert meta.decode_mask[0, 0, 0].tolist() == [True] * 5 + [False] * 7


def test_sharded_checkpoint_loads(tiny, tmp_path):
    tiny.hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_model(str(tmp_path))
    single = load_model(str(tiny.folder))
    ids = torch.tensor([[1, 5, 9, 77]])
    assert torch.equal(sharded.model.forward_dense(ids), single.model.forward_dense(ids))
    (tmp_path / shards[0]).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(str(tmp_path))


def test_kv_ranges_round_trip_through_scattered_blocks():
    from kvmesh.model.attention import read_kv, write_kv_range
    from kvmesh.model.config import ModelConfig

    cfg = ModelConfig(name="t", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_ids=(2,))
    caches = allocate_kv_cache(cfg, num_blocks=8, block_size=4, dtype=torch.float32, device="cpu")
    table = [5, 2, 7, 0]  # positions 0..15 live in these blocks, in this order
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 2, 8, generator=g), torch.randn(2, 10, 2, 8, generator=g)
    write_kv_range(caches, table, 3, k, v)  # positions 3..12
    got_k, got_v = read_kv(caches, table, 3, 13)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.equal(caches[1][0][7, 1], k[1, 6])  # position 9 = block table[2] = 7, offset 1
    assert read_kv(caches, table, 0, 3)[0].abs().sum() == 0  # untouched positions stay zero
    with pytest.raises(ValueError, match="does not fit"):
        write_kv_range(caches, table, 0, k[:, :, :1], v[:, :, :1])
