"""The engine asks the model only for the rows it samples (LlamaForCausalLM.forward's ``keep``):
the same tokens and logprobs as computing the last layer for every row, with less work."""
import pytest
import torch

from engine_utils import greedy, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.model import llama

PROMPTS = {"a": [(17 * i + 2) % 256 for i in range(40)],
           "b": [(5 * i + 9) % 256 for i in range(23)],
           "c": [(11 * i + 1) % 256 for i in range(7)]}
# Starts with a's first 33 tokens: served from the prefix cache once a has run.
AGAIN = {"d": PROMPTS["a"][:33] + [3, 1, 4, 1, 5]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=3))


def _full_last_layer(self, x, cos, sin, kv_cache, attn, keep):
    """The last layer as before: every row, then the kept ones picked."""
    return self.forward(x, cos, sin, kv_cache, attn).index_select(0, torch.tensor(keep, dtype=torch.long))


def _run(tiny, monkeypatch, trim: bool):
    if not trim:
        monkeypatch.setattr(llama.LlamaDecoderLayer, "forward_rows", _full_last_layer)
    rows = []
    hook = tiny.model.model.layers[-1].mlp.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    try:
        # 16 tokens a step: prompts arrive in chunks, beside the decodes of the others
        core = make_core(tiny, max_num_batched_tokens=16, solo_prefill_tokens=0, max_num_seqs=4)
        out = run_all(core, PROMPTS, greedy(12, ignore_eos=True, logprobs=0))
        out.update(run_all(core, AGAIN, greedy(12, ignore_eos=True, logprobs=0)))
        hit = core.cached_prefix_tokens(AGAIN["d"])
    finally:
        hook.remove()
        monkeypatch.undo()
    return out, rows, hit


def test_same_tokens_and_logprobs_as_the_whole_last_layer(tiny, monkeypatch):
    trimmed, rows_trim, hit = _run(tiny, monkeypatch, trim=True)
    full, rows_full, _ = _run(tiny, monkeypatch, trim=False)
    assert hit >= 32  # d's prefix came from the cache
    for rid in [*PROMPTS, *AGAIN]:
        assert trimmed[rid]["tokens"] == full[rid]["tokens"]
        assert [e.logprob for e in trimmed[rid]["logprobs"]] == pytest.approx(
            [e.logprob for e in full[rid]["logprobs"]], abs=1e-5)
    # the trim engaged: the last layer's MLP saw only the sampled rows of prefill steps
    prompt_tokens = sum(len(p) for p in PROMPTS.values()) + len(AGAIN["d"]) - hit
    assert sum(rows_full) - sum(rows_trim) >= prompt_tokens - 2 * len(rows_full)
    assert max(rows_trim) < 16 and max(rows_full) == 16


def test_prompt_logprobs_still_get_every_row(tiny):
    core = make_core(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    out = run_all(core, {"a": PROMPTS["a"]}, greedy(2, ignore_eos=True, prompt_logprobs=0))["a"]
    assert len(out["prompt_logprobs"]) == len(PROMPTS["a"]) - 1
