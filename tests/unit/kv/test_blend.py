"""Blended prefill on a tiny random model: exact at the ends (ratio 1 = full prefill, ratio 0 =
pure reuse), selection by deviation, and quality that improves with the ratio."""
import dataclasses

import pytest
import torch

from engine_utils import load_tiny, make_tiny_checkpoint
from kvmesh.kv.blend import Segment, blend_prefill, segment_kv
from kvmesh.kv.rope import rotate_keys
from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache, read_kv, write_kv_range
from kvmesh.services.engine.config import EngineConfig

BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=3)).model


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def paged_prefill(model, segments: list[Segment]):
    """Reference through the model's own paged path: cached segments imported as they are (keys
    rotated to their positions), new ones computed over everything before them -- the engine's
    pure-reuse semantics; with only new segments, a full prefill. -> k, v [L, T, kvh, hd], logits [vocab]."""
    total = sum(len(s.token_ids) for s in segments)
    nb = -(-total // BLOCK)
    caches = allocate_kv_cache(model.config, nb, BLOCK, model.dtype, "cpu")
    table = list(range(nb))
    start, logits = 0, None
    for seg in segments:
        n = len(seg.token_ids)
        if seg.is_cached:
            write_kv_range(caches, table, start, rotate_keys(seg.k, start, model.rotary).to(model.dtype), seg.v)
        else:
            pos = torch.arange(start, start + n)
            meta = AttentionMetadata.build((pos // BLOCK) * BLOCK + pos % BLOCK, [n], [start + n],
                                           torch.tensor([table]), BLOCK)
            with torch.inference_mode():
                hidden = model(torch.tensor(seg.token_ids), pos, caches, meta)
                logits = model.compute_logits(hidden[-1:])[0]
        start += n
    k, v = read_kv(caches, table, 0, total)
    return k, v, logits


def _prompt(model, seed: int = 0, sizes=(24, 31, 17)):
    """Three passages with KV computed alone, in shuffled order, new text between and after them."""
    passages = [_ids(seed * 10 + i, n) for i, n in enumerate(sizes)]
    cached = [Segment.cached(p, *segment_kv(model, p)) for p in passages]
    return [cached[2], Segment.new(_ids(seed * 10 + 7, 5)), cached[0], cached[1], Segment.new(_ids(seed * 10 + 8, 9))]


def _full(model, segments):
    return paged_prefill(model, [Segment.new(s.token_ids) for s in segments])


@pytest.mark.parametrize("select_layers", [1, 2])
def test_ratio_one_is_full_prefill(model, select_layers):
    segments = _prompt(model)
    k, v, logits = _full(model, segments)
    res = blend_prefill(model, segments, recompute_ratio=1.0, select_layers=select_layers)
    assert res.recomputed.tolist() == list(range(k.shape[1]))
    torch.testing.assert_close(res.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.v, v, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.logits, logits, atol=1e-5, rtol=0)


def test_ratio_zero_is_pure_reuse(model):
    """With a one-layer probe, ratio 0 is exactly what pure reuse through the paged path gives
    (layer 0's KV depends on the token alone; a deeper probe computes the new text's first s
    layers over fresh context instead, which the other tests cover)."""
    segments = _prompt(model)
    res = blend_prefill(model, segments, recompute_ratio=0.0, select_layers=1)
    start = 0
    for seg in segments:  # cached tokens: exactly their reused KV, re-rotated
        n = len(seg.token_ids)
        if seg.is_cached:
            assert torch.equal(res.k[:, start:start + n], rotate_keys(seg.k, start, model.rotary).to(model.dtype))
            assert torch.equal(res.v[:, start:start + n], seg.v)
        start += n
    is_new = [not s.is_cached for s in segments for _ in s.token_ids]
    assert res.recomputed.tolist() == [p for p, fresh in enumerate(is_new) if fresh]
    # new text: computed over the reused KV, as the engine's paged path does
    k, v, logits = paged_prefill(model, segments)
    torch.testing.assert_close(res.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.v, v, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.logits, logits, atol=1e-5, rtol=0)


def test_single_segment(model):
    ids = _ids(42, 40)
    k, v, logits = _full(model, [Segment.new(ids)])
    alone = blend_prefill(model, [Segment.new(ids)], recompute_ratio=0.0)
    torch.testing.assert_close(alone.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone.logits, logits, atol=1e-5, rtol=0)
    # cached at the position it was computed at: nothing to restore, reuse is already exact
    reused = blend_prefill(model, [Segment.cached(ids, *segment_kv(model, ids))], recompute_ratio=0.0)
    assert reused.recomputed.tolist() == [39]  # only the last token, for its logits
    assert torch.nanquantile(reused.deviation, 1.0) < 1e-8
    torch.testing.assert_close(reused.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(reused.v, v, atol=1e-5, rtol=0)
    torch.testing.assert_close(reused.logits, logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("select_layers", [1, 2])
def test_selection_picks_the_largest_deviation(model, select_layers):
    segments = _prompt(model, seed=3)
    seg = segments[2]
    target = len(segments[0].token_ids) + len(segments[1].token_ids) + 11
    k, v = seg.k.clone(), seg.v.clone()
    v[1, 11] += 5.0 * v[1].std()  # a damaged reused value on layer 1 (one the probe compares)
    segments[2] = Segment.cached(seg.token_ids, k, v)
    res = blend_prefill(model, segments, recompute_ratio=0.03, select_layers=select_layers,
                        selection="deviation")  # 2 of 72
    cached = ~torch.isnan(res.deviation)
    assert int(cached.sum()) == 72
    assert res.deviation.nan_to_num(-1).argmax().item() == target
    top2 = res.deviation.nan_to_num(-1).topk(2).indices.tolist()
    picked = [p for p in res.recomputed.tolist() if cached[p]]
    assert sorted(picked) == sorted(top2)
    assert target in picked


def test_error_shrinks_as_the_ratio_grows(model):
    errors = {0.0: 0.0, 0.5: 0.0, 1.0: 0.0}
    for seed in range(3):
        segments = _prompt(model, seed=seed)
        _, _, full = _full(model, segments)
        # KL in float64: computed in fp32 it carries +-1e-7 of rounding noise, above the bound below
        ref = torch.log_softmax(full.double(), -1)
        for ratio in errors:
            got = torch.log_softmax(blend_prefill(model, segments, recompute_ratio=ratio).logits.double(), -1)
            errors[ratio] += float((ref.exp() * (ref - got)).sum())  # KL(full || blended)
    assert errors[0.0] > errors[0.5] > errors[1.0]
    assert errors[0.0] > 1e-3  # the case does have cross-segment attention to restore
    assert errors[1.0] < 1e-8


def test_bad_input_says_how_to_fix(model):
    ids = _ids(1, 8)
    k, v = segment_kv(model, ids)
    with pytest.raises(ValueError, match="recompute_ratio"):
        blend_prefill(model, [Segment.new(ids)], recompute_ratio=1.5)
    with pytest.raises(ValueError, match="select_layers must be in 1..2"):
        blend_prefill(model, [Segment.new(ids)], select_layers=3)
    with pytest.raises(ValueError, match=r"\[layers, tokens, kv_heads, head_dim\]"):
        blend_prefill(model, [Segment.cached(ids, k[:, :4], v[:, :4])])
    with pytest.raises(ValueError, match="no tokens"):
        blend_prefill(model, [Segment.new([]), Segment.new(ids)])
    with pytest.raises(ValueError, match="at least one segment"):
        blend_prefill(model, [])


def test_continuation_logprobs_equal_a_full_forward(model):
    """Scoring an answer over a prefill's KV gives the log-probs a dense forward of prompt +
    answer gives; hidden_states are the dense forward's final-norm states."""
    from kvmesh.kv.blend import continuation_logprobs, hidden_states

    prompt, answer = _ids(5, 40), _ids(6, 9)
    full = blend_prefill(model, [Segment.new(prompt)], recompute_ratio=1.0)
    got = continuation_logprobs(model, full.k, full.v, full.logits, answer)
    with torch.inference_mode():
        logits = model.forward_dense(torch.tensor([prompt + answer]))[0]
    want = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).gather(1, torch.tensor(answer)[:, None])[:, 0]
    assert got.shape == (len(answer),)
    assert torch.allclose(got, want, atol=1e-4)
    h = hidden_states(model, prompt)
    assert torch.allclose(model.compute_logits(h), logits[:len(prompt)], atol=1e-4)
    with pytest.raises(ValueError, match="at least one token"):
        continuation_logprobs(model, full.k, full.v, full.logits, [])


def test_probe_first_then_finish_is_the_same_blend(model):
    """The two stages (probe while the KV is fetched, then finish) give what one call gives."""
    from kvmesh.kv.blend import BlendPrefill

    segments = _prompt(model)
    ids = [t for seg in segments for t in seg.token_ids]
    whole = blend_prefill(model, segments, 0.3)
    job = BlendPrefill(model, ids)
    job.probe()
    assert job.probed
    staged = job.finish(segments, 0.3)
    assert torch.equal(staged.recomputed, whole.recomputed)
    assert torch.allclose(staged.k, whole.k) and torch.allclose(staged.logits, whole.logits)
    with pytest.raises(ValueError, match="not the prompt"):
        BlendPrefill(model, ids[:-1]).finish(segments, 0.3)


def test_every_kv_position_is_written_before_it_is_read(model, monkeypatch):
    """The output KV is allocated uninitialized: poison it with NaN and the blend must not change."""
    import kvmesh.kv.blend as blend_mod

    segments = _prompt(model)
    clean = blend_prefill(model, segments, 0.15)

    def poisoned(*shape, **kw):
        return torch.full(*shape, float("nan"), **kw)

    monkeypatch.setattr(blend_mod.torch, "empty", poisoned)
    dirty = blend_prefill(model, segments, 0.15)
    assert torch.isfinite(dirty.k).all() and torch.isfinite(dirty.v).all()
    assert torch.equal(dirty.k, clean.k) and torch.equal(dirty.logits, clean.logits)


def test_attention_aware_selection_keeps_the_deviation_signal_and_weighs_what_the_end_reads(model):
    """deviation+attention: a token whose reused KV is badly off is still recomputed; the choice
    among the rest follows what the prompt's last tokens attend to, so it differs from deviation
    alone; both selections keep ratio 0 and 1 exact."""
    from kvmesh.kv.blend import SELECTIONS

    segments = _prompt(model, seed=3)
    seg = segments[2]
    target = len(segments[0].token_ids) + len(segments[1].token_ids) + 11
    v = seg.v.clone()
    v[1, 11] += 5.0 * v[1].std()
    segments[2] = Segment.cached(seg.token_ids, seg.k, v)
    both = blend_prefill(model, segments, 0.2, selection="deviation+attention")
    alone = blend_prefill(model, segments, 0.2, selection="deviation")
    assert target in both.recomputed.tolist() and target in alone.recomputed.tolist()
    assert len(both.recomputed) == len(alone.recomputed)
    assert both.recomputed.tolist() != alone.recomputed.tolist()
    for selection in SELECTIONS:
        full = blend_prefill(model, segments, 1.0, selection=selection)
        assert len(full.recomputed) == sum(len(x.token_ids) for x in segments)
    with pytest.raises(ValueError, match="selection must be one of"):
        blend_prefill(model, segments, 0.2, selection="random")


def test_sinks_selection_takes_every_cached_segment_start_first(model):
    """"sinks+deviation+attention": each cached segment's first SINK_TOKENS tokens are recomputed
    before any other (inside the ratio's budget); the ends stay exact (0 = reuse, 1 = full)."""
    from kvmesh.kv.blend import SINK_TOKENS

    segments = _prompt(model)
    starts, start = [], 0
    for seg in segments:
        if seg.is_cached:
            starts.append(start)
        start += len(seg.token_ids)
    sinks = {s + i for s in starts for i in range(SINK_TOKENS)}
    res = blend_prefill(model, segments, recompute_ratio=0.2, select_layers=1, selection="sinks+deviation+attention")
    picked = {p for p in res.recomputed.tolist() if not torch.isnan(res.deviation[p])}
    assert len(picked) == round(0.2 * 72) and sinks <= picked
    # a budget smaller than the sinks: only sinks
    res = blend_prefill(model, segments, recompute_ratio=0.1, select_layers=1, selection="sinks+deviation+attention")
    picked = {p for p in res.recomputed.tolist() if not torch.isnan(res.deviation[p])}
    assert len(picked) == round(0.1 * 72) and picked <= sinks
    reuse = blend_prefill(model, segments, recompute_ratio=0.0, select_layers=1)
    sinks0 = blend_prefill(model, segments, recompute_ratio=0.0, select_layers=1, selection="sinks+deviation+attention")
    assert torch.equal(sinks0.recomputed, reuse.recomputed) and torch.equal(sinks0.k, reuse.k)
    k, v, logits = _full(model, segments)
    full = blend_prefill(model, segments, recompute_ratio=1.0, selection="sinks+deviation+attention")
    torch.testing.assert_close(full.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(full.logits, logits, atol=1e-5, rtol=0)


def test_deep_attention_selection_follows_what_the_end_reads_in_deep_layers(model, monkeypatch):
    """deviation+deep-attention (the default): the attention the prompt's end pays through the
    layers past the probe enters the score, so a cached token it reads heavily is recomputed
    although its deviation is unremarkable; ratios 0 and 1 stay exact (pure reuse, full prefill),
    and the pass that measures it leaves nothing behind (the same KV as without it at ratio 0)."""
    import kvmesh.kv.blend as blend_mod
    from kvmesh.kv.blend import DEFAULT_SELECTION, SELECTIONS

    assert DEFAULT_SELECTION == "deviation+deep-attention"
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == "blend_selection")
    meta = next(iter(field.metadata.values()))  # the engine's flag offers exactly these
    assert field.default == DEFAULT_SELECTION and set(meta.choices) == set(SELECTIONS)

    segments = _prompt(model, seed=5)
    plain = blend_prefill(model, segments, 0.1, select_layers=1, selection="deviation")
    dev = plain.deviation.nan_to_num(float("inf"))
    cached = ~torch.isnan(plain.deviation)
    target = int(torch.where(cached, dev, torch.full_like(dev, float("inf"))).argmin())  # least deviating
    assert target not in plain.recomputed.tolist()
    real = blend_mod.BlendPrefill._deep_attention
    seen = []

    def one_hot(self, out_k, *args):
        out = real(self, out_k, *args)  # the pass runs, and its [T] share sums to ~1 per layer
        seen.append(float(out.sum()))
        hot = torch.zeros_like(out)
        hot[target] = 1.0
        return hot

    monkeypatch.setattr(blend_mod.BlendPrefill, "_deep_attention", one_hot)
    deep = blend_prefill(model, segments, 0.1, select_layers=1)
    assert target in deep.recomputed.tolist()
    assert seen and abs(seen[0] - 1.0) < 1e-4
    monkeypatch.undo()
    reuse = blend_prefill(model, segments, 0.0, select_layers=1)
    reuse_plain = blend_prefill(model, segments, 0.0, select_layers=1, selection="deviation")
    assert torch.equal(reuse.k, reuse_plain.k) and torch.equal(reuse.v, reuse_plain.v)
    assert torch.equal(reuse.logits, reuse_plain.logits)
    k, v, logits = _full(model, segments)
    full = blend_prefill(model, segments, 1.0)
    torch.testing.assert_close(full.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(full.logits, logits, atol=1e-5, rtol=0)
