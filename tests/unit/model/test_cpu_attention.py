"""kvmesh.model.cpu_attention: fp32 causal prefill attention with AVX-512 FMAs -- against SDPA in
fp64 (and no further from it than torch's own fp32 SDPA) for every head size and GQA grouping it
takes, its masking, a query's bits independent of how its prompt was chunked, and its use by
paged_attention on a CPU without AMX."""

from __future__ import annotations

import pytest
import torch

from kvmesh.model import amx_attention, cpu_attention

from .test_amx_attention import check_later_keys, check_masked_huge_score, check_paged_attention_uses, reference

needs_avx512 = pytest.mark.skipif(cpu_attention._ops() is None,
                                  reason="no AVX-512 here (or the kernel could not be built)")


def fused(lq: int, offset: int, heads: int, kvh: int, hd: int = 64, spread: float = 1.0, seed: int = 0):
    """q, k, v (fp32) as strided views of one [tokens, heads + 2 kvh, hd] projection: q the last lq tokens."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(offset + lq, heads + 2 * kvh, hd, generator=g) * spread
    return qkv[offset:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]


SHAPES = [(1, 0, 9, 3, 64), (15, 0, 9, 3, 64), (16, 0, 9, 3, 64), (17, 0, 9, 3, 64), (200, 0, 9, 3, 64),
          (40, 300, 9, 3, 64), (1, 129, 4, 1, 64), (130, 127, 2, 2, 64), (64, 200, 9, 3, 64),
          (33, 20, 8, 2, 128), (50, 0, 4, 4, 16), (21, 11, 6, 3, 32), (37, 5, 5, 1, 80), (19, 40, 4, 2, 96)]


@needs_avx512
@pytest.mark.parametrize("lq, offset, heads, kvh, hd", SHAPES)
def test_is_as_close_to_exact_as_torch_fp32(lq, offset, heads, kvh, hd):
    q, k, v = fused(lq, offset, heads, kvh, hd, spread=2.0)
    out = torch.full((lq, heads, hd), float("nan"))
    assert cpu_attention.causal_attention_(out, q, k, v, offset, hd ** -0.5)
    exact = reference(q, k, v, offset, hd ** -0.5, torch.float64)
    err = (out - exact).abs().max().item()
    torch_fp32 = (reference(q, k, v, offset, hd ** -0.5) - exact).abs().max().item()
    assert err <= 2 * torch_fp32 + 1e-6, (err, torch_fp32)
    assert err < 2e-5


@needs_avx512
def test_later_keys_never_reach_earlier_queries():
    """Changing the keys and values after position p leaves the outputs of queries up to p bit
    for bit, inside a 16-key step as across steps."""
    check_later_keys(cpu_attention, *fused(150, 0, 9, 3, seed=1))


@needs_avx512
@pytest.mark.parametrize("cut", [1, 16, 37, 100])
def test_a_query_has_the_same_bits_however_its_prompt_is_chunked(cut):
    """A prompt attended whole, and as two chunks (the second over the first's keys as cached
    context), gives every query the same bits: the score order, the key steps and the masked
    steps do not depend on where a chunk starts or ends."""
    q, k, v = fused(130, 0, 9, 3, seed=5, spread=2.0)
    whole = torch.empty_like(q)
    cpu_attention.causal_attention_(whole, q, k, v, 0, 0.125)
    first, second = torch.empty_like(q[:cut]), torch.empty_like(q[cut:])
    cpu_attention.causal_attention_(first, q[:cut], k[:cut], v[:cut], 0, 0.125)
    cpu_attention.causal_attention_(second, q[cut:], k, v, cut, 0.125)
    assert torch.equal(torch.cat([first, second]), whole)


@needs_avx512
@pytest.mark.parametrize("offset", [120, 7])
def test_a_masked_key_with_a_huge_score_changes_nothing(offset):
    """A later key whose score dwarfs every other is masked for the queries before it (inside a
    16-key step and in the step after theirs), so their outputs stay finite and exact."""
    check_masked_huge_score(cpu_attention, offset, torch.float32, 2e-5)


@needs_avx512
@pytest.mark.parametrize("lq, offset, heads, kvh, hd", SHAPES[::3])
def test_bf16_is_fp32_attention_rounded_once(lq, offset, heads, kvh, hd):
    """bf16 q, k, v are attended in fp32: the output is the fp32 kernel's on the same (bf16)
    values, rounded to bf16, so no further from fp32 SDPA than one bf16 rounding."""
    q, k, v = (t.bfloat16() for t in fused(lq, offset, heads, kvh, hd, spread=2.0))
    out = torch.full((lq, heads, hd), float("nan"), dtype=torch.bfloat16)
    assert cpu_attention.causal_attention_(out, q, k, v, offset, hd ** -0.5)
    in_fp32 = torch.empty(lq, heads, hd)
    assert cpu_attention.causal_attention_(in_fp32, q.float(), k.float(), v.float(), offset, hd ** -0.5)
    assert torch.equal(out, in_fp32.bfloat16())
    exact = reference(q, k, v, offset, hd ** -0.5, torch.float64)
    torch_bf16 = (reference(q, k, v, offset, hd ** -0.5, torch.bfloat16) - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= torch_bf16 + 1e-6


def test_refuses_what_it_does_not_compute():
    """fp16, mixed dtypes, head sizes it has no instance for and tokens whose heads are not
    contiguous return False (the caller runs SDPA) and write nothing."""
    q, k, v = fused(8, 0, 4, 2)
    out = torch.zeros(8, 4, 64)
    assert not cpu_attention.causal_attention_(out, q, k.bfloat16(), v, 0, 0.125)
    q48 = torch.zeros(8, 2, 48)
    assert not cpu_attention.causal_attention_(q48.clone(), q48, q48[:, :1], q48[:, :1], 0, 0.1)
    assert not cpu_attention.causal_attention_(out, q.transpose(0, 1).contiguous().transpose(0, 1), k, v, 0, 0.1)
    assert not cpu_attention.usable(q.half()) and not cpu_attention.usable(q48)
    assert torch.count_nonzero(out) == 0


def test_the_switch_turns_it_off(monkeypatch):
    """KVMESH_CPU_ATTENTION=0 turns a built module down (SDPA runs), for comparisons."""
    class Built:
        def available(self):
            return True

    monkeypatch.setenv("KVMESH_CPU_ATTENTION", "0")
    assert not cpu_attention._accept(Built())
    monkeypatch.delenv("KVMESH_CPU_ATTENTION")
    assert cpu_attention._accept(Built())


@needs_avx512
def test_bad_shapes_get_a_clear_error():
    q, k, v = fused(8, 4, 4, 2)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="Lk must be offset"):
        cpu_attention.causal_attention_(out, q, k, v, 0, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KVH"):
        cpu_attention.causal_attention_(out[:, :3], q[:, :3], k, v, 4, 0.125)


@needs_avx512
@pytest.mark.parametrize("chunks", [[37], [20, 17]])  # one whole prompt; a chunk over cached context
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 3e-2), (torch.float32, 2e-5)])
def test_paged_attention_uses_it_without_amx(chunks, dtype, atol, monkeypatch):
    """paged_attention in fp32 and bf16 on a CPU without AMX sends prefill chunks to the kernel,
    and its outputs match the SDPA path's to the dtype's rounding."""
    monkeypatch.setattr(amx_attention, "usable", lambda q: False)
    check_paged_attention_uses(cpu_attention, chunks, dtype, atol, monkeypatch)


def test_an_fp32_engine_without_amx_builds_the_kernel_at_start(tmp_path, monkeypatch):
    """build_core builds (or finds) this kernel while an fp32 engine starts on a CPU without AMX
    (and not where the AMX kernel runs), so the first prompt does not wait for a compiler."""
    from engine_utils import make_tiny_checkpoint
    from kvmesh.services.engine.build import build_core
    from kvmesh.services.engine.config import EngineConfig

    folder = make_tiny_checkpoint(tmp_path, num_layers=1)
    calls = []
    monkeypatch.setattr(cpu_attention, "prepare", lambda: calls.append(1) or True)
    for amx in (False, True):
        monkeypatch.setattr(amx_attention, "prepare", lambda amx=amx: amx)
        build_core(EngineConfig(model=str(folder), num_blocks=8, block_size=16,
                                max_num_batched_tokens=16, max_num_seqs=2))
    assert calls == [1]
