"""kvmesh.gpu.decode_graphs: the decode step the engine captures as a CUDA graph, against the engine's
own paged forward (on CPU with Triton's interpreter, natively on CUDA where there is one).

On CPU nothing is captured: the same code runs eagerly on the same static buffers, which checks
everything but the capture itself (inputs, padding rows, the scratch block, the runner's choice of
steps); scripts/gpu_check.sh runs these tests on a GPU, where the replays are real.

Tolerances: the two paths differ in the attention kernel (fp32 here: only the summation order)
and, on CUDA, in the batch the matmuls see (padding rows): 1e-4 on logits of magnitude ~10.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[test]'")
from kvmesh.gpu.decode_graphs import DecodeGraphs, decode_forward, graph_batch_sizes  # noqa: E402
from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache  # noqa: E402
from kvmesh.model.loader import load_model  # noqa: E402

BS = 16
BLOCKS = 20
LENS = [1, 17, 40]  # context after the step: a first token, a new block, a partial third block


from tests.unit.gpu.conftest import TINY  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama in fp32 (transformers' initialisation; no service dependencies, so this
    runs on a bare GPU machine too)."""
    pytest.importorskip("transformers")
    from kvmesh.loadtest.gpu_engine_bench import random_checkpoint

    path = tmp_path_factory.mktemp("tiny_graphs")
    random_checkpoint(path, TINY, dtype=torch.float32)
    return path


def _filled_caches(loaded, device, seed=0):
    """A pool of BLOCKS + 1 blocks (the last is the scratch block) of random KV."""
    g = torch.Generator().manual_seed(seed)
    caches = allocate_kv_cache(loaded.config, BLOCKS + 1, BS, loaded.dtype, device)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return caches


def _step_inputs():
    """Scattered block tables for LENS, and each sequence's decode-step inputs."""
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(BLOCKS, generator=g).tolist()
    tables, at = [], 0
    for n in LENS:
        need = -(-n // BS)
        tables.append(order[at:at + need])
        at += need
    positions = [n - 1 for n in LENS]
    slots = [t[p // BS] * BS + p % BS for t, p in zip(tables, positions)]
    ids = [(7 * i + 3) % 256 for i in range(len(LENS))]
    return ids, positions, slots, tables


def _engine_step(loaded, caches, ids, positions, slots, tables, device):
    """The engine's eager paged forward of the same step: logits [n, vocab]."""
    width = max(len(t) for t in tables)
    meta = AttentionMetadata.build(torch.tensor(slots, device=device), [1] * len(ids), list(LENS),
                                   torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device), BS)
    h = loaded.model.forward(torch.tensor(ids, device=device), torch.tensor(positions, device=device), caches, meta)
    return loaded.model.compute_logits(h)


def _reference(device, folder):
    """The model, the step's inputs, the engine's logits of the step and its caches after it, and
    a fresh copy of the caches before it."""
    loaded = load_model(str(folder), dtype="float32", device=device, progress=False)
    inputs = _step_inputs()
    ref_caches = _filled_caches(loaded, device)
    ref = _engine_step(loaded, ref_caches, *inputs, device)
    return loaded, inputs, ref, ref_caches, _filled_caches(loaded, device)


@torch.inference_mode()
def test_decode_forward_matches_the_engine_forward(device, folder):
    loaded, (ids, positions, slots, tables), ref, ref_caches, caches = _reference(device, folder)
    width = 4
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    out = decode_forward(loaded.model, caches, torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                         torch.tensor(slots, device=device), padded, torch.tensor(LENS, device=device),
                         max_seq_len=width * BS)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    for (k, v), (rk, rv) in zip(caches, ref_caches):  # the same new keys and values, in the same slots
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_padding_rows_touch_only_the_scratch_block(device, folder):
    loaded, (ids, positions, slots, tables), ref, ref_caches, caches = _reference(device, folder)
    graphs = DecodeGraphs(loaded.model, caches, scratch_block=BLOCKS, max_blocks=4, batch_sizes=(1, 2, 8))
    if device == "cuda":
        graphs.capture()
    assert graphs.padded_size(3) == 8  # 5 padding rows
    out = graphs.run(ids, positions, slots, LENS, tables)
    assert graphs.steps == 1 and graphs.replays == (1 if device == "cuda" else 0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    for (k, v), (rk, rv) in zip(caches, ref_caches):
        torch.testing.assert_close(k[:BLOCKS], rk[:BLOCKS], atol=1e-5, rtol=0)
        torch.testing.assert_close(v[:BLOCKS], rv[:BLOCKS], atol=1e-5, rtol=0)
    # a smaller step next reuses the buffers: the rows of the bigger one must not leak into it
    out1 = graphs.run(ids[:1], positions[:1], slots[:1], LENS[:1], tables[:1])
    torch.testing.assert_close(out1, ref[:1], atol=1e-4, rtol=0)


def test_bad_steps_are_refused(folder):
    loaded = load_model(str(folder), dtype="float32", device="cpu", progress=False)
    caches = _filled_caches(loaded, "cpu")
    graphs = DecodeGraphs(loaded.model, caches, scratch_block=BLOCKS, max_blocks=2, batch_sizes=(1, 2))
    with pytest.raises(ValueError, match="captured sizes"):
        graphs.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [1, 1, 1], [[0], [1], [2]])
    with pytest.raises(ValueError, match="3 blocks"):
        graphs.run([1], [40], [40], [41], [[0, 1, 2]])
    with pytest.raises(ValueError, match="scratch block"):
        DecodeGraphs(loaded.model, caches, scratch_block=BLOCKS + 1, max_blocks=2)


def test_graph_batch_sizes_cover_every_batch_up_to_the_engine_limit():
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(1) == (1,)


def test_the_engine_with_decode_graphs_gives_the_same_tokens(device, tmp_path, monkeypatch):
    """Whole requests through EngineCore: prefill chunks eager, decode steps through the graphs'
    path, the same greedy tokens as the engine without it. (Skips where the services' own
    dependencies and generated stubs are missing, as on a bare GPU machine.)"""
    utils = pytest.importorskip("tests.engine_utils", reason="the engine's service dependencies are not installed")
    greedy, make_core, run_all = utils.greedy, utils.make_core, utils.run_all
    import kvmesh.services.engine.build as build

    folder = utils.make_tiny_checkpoint(tmp_path / "tiny", num_layers=2)  # peaky logits: no near-ties
    loaded = load_model(str(folder), dtype="float32", device=device, progress=False)
    prompts = {"a": list(b"hello graphs"), "b": list(b"a longer prompt, over one block of keys"), "c": [5]}
    params = greedy(12, ignore_eos=True)
    plain = run_all(make_core(loaded, cuda_graphs=False), prompts, params)
    monkeypatch.setattr(build, "cuda_graph_sizes", lambda cfg, loaded: (1, 2, 4))
    core = make_core(loaded)
    graphed = run_all(core, prompts, params)
    assert {r: graphed[r]["tokens"] for r in prompts} == {r: plain[r]["tokens"] for r in prompts}
    graphs = core.runner.graphs
    # 12 tokens each: the first from the prefill, at least 11 decode steps through the graphs
    assert graphs is not None and graphs.steps >= 11
    assert graphs.replays == (graphs.steps if device == "cuda" else 0)
