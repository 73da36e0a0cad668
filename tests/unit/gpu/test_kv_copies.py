"""services/engine/kv_copies.py: KV imports and exports on the engine's copy stream (CUDA), passed
through off CUDA; and the runner's import and export paths over them, on either device.

On a GPU (scripts/gpu_check.sh) the copies really run on their own stream: the tests check that the
values arrive whole although nothing synchronises the host before the step or the export's wait.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.services.engine.block_manager import BlockManager
from kvmesh.services.engine.kv_copies import KvCopies, StagedKv
from kvmesh.services.engine.runner import ModelRunner
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.services.engine.sequence import Sequence

BS = 16


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(name)


@pytest.fixture(params=["cpu", "cuda"])
def dev(request) -> torch.device:
    return _device(request.param)


@pytest.fixture(scope="module")
def loaded_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from kvmesh.loadtest.gpu_engine_bench import random_checkpoint
    from tests.unit.gpu.conftest import TINY

    path = tmp_path_factory.mktemp("tiny_copies")
    random_checkpoint(path, TINY, dtype=torch.float32)
    return path


def test_off_cuda_everything_passes_through():
    copies = KvCopies(torch.device("cpu"))
    k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    assert copies.to_device((k, v)) == (k, v)
    assert copies.ready((k, v)) == (k, v)
    hk, hv, wait = copies.to_host(k, v)
    assert hk is k and hv is v and wait is None
    assert copies.staged == copies.exported == 0


def test_cuda_copies_run_on_their_stream_and_arrive_whole():
    dev = _device("cuda")
    copies = KvCopies(dev)
    k, v = torch.randn(30, 256, 3, 64), torch.randn(30, 256, 3, 64)
    staged = copies.to_device((k, v))
    assert isinstance(staged, StagedKv) and staged.k.device.type == "cuda"
    # keep the compute stream busy, then use the payload on it: the stream waits, the host does not
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(8):
        a = a @ a / 2048
    dk, dv = copies.ready(staged)
    total = (dk.float().sum() + dv.float().sum()).item()
    assert total == pytest.approx((k.sum() + v.sum()).item(), rel=1e-4, abs=1e-2)
    # an export of tensors computed on the compute stream after more queued work
    for _ in range(8):
        a = a @ a / 2048
    x = dk * 2 + a[0, 0] * 0
    hk, hv, wait = copies.to_host(x, dv)
    assert hk.is_pinned() and wait is not None
    wait()
    assert torch.equal(hk, (k * 2)) and torch.equal(hv, v)
    assert copies.staged == 1 and copies.exported == 1


@torch.inference_mode()
def test_the_runner_imports_a_staged_payload_and_exports_through_the_host(dev, loaded_folder):
    from kvmesh.model.loader import load_model

    loaded = load_model(str(loaded_folder), dtype="float32", device=dev, progress=False)
    cfg = loaded.config
    runner = ModelRunner(loaded, num_blocks=16, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=BS),
                      BlockManager(runner.num_blocks, BS, enable_prefix_caching=False))
    g = torch.Generator().manual_seed(3)
    shape = (cfg.num_layers, 2 * BS, cfg.num_kv_heads, cfg.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    seq = Sequence("r", list(range(1, 2 * BS + 6)), SamplingParams(max_tokens=1))
    seq.external_kv, seq.external_start, seq.external_tokens = runner.stage_kv((k, v)), 0, 2 * BS
    assert isinstance(seq.external_kv, StagedKv) == (dev.type == "cuda")
    sched.add(seq)
    out = sched.schedule()
    assert len(out.imports) == 1 and out.scheduled[0].num_new_tokens == 5
    runner.execute(out)
    sched.commit(out)
    hk, hv, wait = runner.read_kv_to_host(seq, 0, 2 * BS)
    if wait is not None:
        wait()
    assert hk.device.type == "cpu"
    assert torch.equal(hk, k) and torch.equal(hv, v)
    # the positions computed after the import are exported too (the compute stream's writes)
    rk, rv = runner.read_kv(seq, 2 * BS, 2 * BS + 5)
    hk, hv, wait = runner.read_kv_to_host(seq, 2 * BS, 2 * BS + 5)
    if wait is not None:
        wait()
    assert torch.equal(hk, rk.cpu()) and torch.equal(hv, rv.cpu())
