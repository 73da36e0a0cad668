"""LlamaForCausalLM.forward's ``keep``: the last layer computes every row's keys and values but
its attention, o and MLP for the kept rows only (AttentionMetadata.rows_as_decodes)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.model.loader import load_model

ATOL = 2e-5  # fp32: the kept rows are attended by the decode path, so reduction order may differ

# One step: sequence 0 brings a 9-token chunk over 6 cached tokens, sequence 1 decodes one token
# over 10, sequence 2 brings its first 7 tokens (no earlier context).
Q_LENS, CTX_LENS = [9, 1, 7], [15, 11, 7]


def _step(model, seed: int = 0):
    """A filled cache for the earlier context, and the step's inputs (ids, positions, meta)."""
    bs = 4
    g = torch.Generator().manual_seed(seed)
    kv = allocate_kv_cache(model.config, 48, bs, torch.float32, "cpu")
    for k, v in kv:  # earlier context: any values (the step must read them, not overwrite them)
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    tables = torch.randperm(48, generator=g)[:3 * 8].view(3, 8)
    ids, pos, slots = [], [], []
    for s, (q, c) in enumerate(zip(Q_LENS, CTX_LENS)):
        for p in range(c - q, c):
            ids.append(int(torch.randint(0, 128, (1,), generator=g)))
            pos.append(p)
            slots.append(int(tables[s, p // bs]) * bs + p % bs)
    meta = AttentionMetadata(torch.tensor(slots), list(Q_LENS), list(CTX_LENS), tables)
    return kv, torch.tensor(ids), torch.tensor(pos), meta


def _fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping, list(meta.query_lens), list(meta.context_lens), meta.block_tables)


def test_rows_as_decodes_gives_each_row_its_own_context():
    tables = torch.arange(24).view(3, 8)
    slots = torch.arange(100, 117)
    meta = AttentionMetadata.build(slots, Q_LENS, CTX_LENS, tables, 4)
    rows = [0, 8, 9, 10, 16]  # first and last of the chunk, the decode, first and last of the new prompt
    sub = meta.rows_as_decodes(rows)
    assert sub.query_lens == [1] * 5 and sub.all_decode
    assert sub.context_lens == [7, 15, 11, 1, 7]
    assert sub.slot_mapping.tolist() == [100, 108, 109, 110, 116]
    assert sub.block_tables.tolist() == [tables[0].tolist()] * 2 + [tables[1].tolist()] + [tables[2].tolist()] * 2
    with pytest.raises(ValueError, match="not a token of this step"):
        meta.rows_as_decodes([17])
    with pytest.raises(ValueError, match="not sorted"):
        meta.rows_as_decodes([9, 8])
    with pytest.raises(ValueError, match="prepare"):
        AttentionMetadata(slots, Q_LENS, CTX_LENS, tables).rows_as_decodes([0])


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("keep", [[8, 9, 16], [9], []])
def test_kept_rows_and_every_cache_match_the_full_forward(tiny, keep, window):
    model = load_model(str(tiny.folder)).model
    last = model.model.layers[-1]
    last.self_attn.window = window  # the decode path's window masks too (Mistral-style layers)
    rows_seen = []
    hook = last.mlp.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
    try:
        kv_full, ids, pos, meta = _step(model)
        kv_keep = [(k.clone(), v.clone()) for k, v in kv_full]
        with torch.inference_mode():
            full = model(ids, pos, kv_full, meta)
            kept = model(ids, pos, kv_keep, _fresh(meta), keep=keep)
    finally:
        hook.remove()
        last.self_attn.window = None
    assert rows_seen == [ids.shape[0]] + ([len(keep)] if keep else [])  # the last MLP: kept rows only
    assert kept.shape == (len(keep), model.config.hidden_size)
    torch.testing.assert_close(kept, full[keep], atol=ATOL, rtol=0)
    for (kf, vf), (kk, vk) in zip(kv_full, kv_keep):  # every layer's new keys/values, same bits
        assert torch.equal(kf, kk) and torch.equal(vf, vk)


def test_a_wrong_kept_row_would_show(tiny):
    """The comparison above can fail: the last row of the chunk attended with the chunk's
    first-row context (a plausible off-by-one in rows_as_decodes) moves its hidden state."""
    model = load_model(str(tiny.folder)).model
    kv, ids, pos, meta = _step(model)
    with torch.inference_mode():
        full = model(ids, pos, [(k.clone(), v.clone()) for k, v in kv], meta)
        meta2 = _fresh(meta)
        wrong = AttentionMetadata.rows_as_decodes

        def off_by_chunk(self, rows):
            sub = wrong(self, rows)
            return AttentionMetadata.build(sub.slot_mapping, sub.query_lens,
                                           [c - 8 if r == 8 else c for r, c in zip(rows, sub.context_lens)],
                                           sub.block_tables, self.block_size)
        AttentionMetadata.rows_as_decodes = off_by_chunk
        try:
            bad = model(ids, pos, kv, meta2, keep=[8])
        finally:
            AttentionMetadata.rows_as_decodes = wrong
    assert (bad[0] - full[8]).abs().max() > 100 * ATOL
