"""The draft service's model drafter (services/draft/model_drafter.py) on a CUDA device: its drafts
are the draft model's greedy continuation, as on CPU (tests/unit/draft covers the drafter's logic
there). Skips without CUDA; scripts/gpu_check.sh runs it on a GPU."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")
from kvmesh.model.loader import load_model  # noqa: E402
from kvmesh.services.draft.drafters import DraftJob  # noqa: E402
from kvmesh.services.draft.model_drafter import ModelDrafter  # noqa: E402
from kvmesh.services.draft.state import SequenceState  # noqa: E402


@torch.inference_mode()
def _greedy(loaded, tokens: list[int], k: int) -> list[int]:
    out = list(tokens)
    for _ in range(k):
        logits = loaded.model.forward_dense(torch.tensor([out], device=loaded.device))
        out.append(int(logits[0, -1].argmax()))
    return out[len(tokens):]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_drafter_drafts_the_greedy_continuation_on_cuda(tmp_path, dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kvmesh.loadtest.gpu_engine_bench import random_checkpoint
    from tests.unit.gpu.conftest import TINY

    random_checkpoint(tmp_path / "m", TINY, dtype=torch.float32, init=0.2)
    loaded = load_model(str(tmp_path / "m"), dtype=dtype, device="cuda", progress=False)
    drafter = ModelDrafter(loaded, num_blocks=64, block_size=16, catch_up_tokens=4096)
    rng = random.Random(0)
    states = [SequenceState(f"s{i}", [rng.randrange(3, 300) for _ in range(n)]) for i, n in enumerate((1, 9, 40))]
    budgets = (4, 2, 6)
    proposals = drafter.propose([DraftJob(s, k) for s, k in zip(states, budgets)])
    for state, k, proposal in zip(states, budgets, proposals):
        assert len(proposal.token_ids) == k
        assert proposal.token_ids == _greedy(loaded, state.tokens, k)  # the same model, dense and uncached
