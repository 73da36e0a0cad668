"""SamplingParams.prompt_logprobs on a tiny model: exact against a dense forward, across prefill
chunks and a preemption, without prefix-cache reuse, and without changing the generated output."""
import pytest
import torch

from engine_utils import greedy, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.core import EngineRequest
from kvmesh.services.engine.sampling import SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _prompt(n, offset=0):
    return [(11 * i + 5 + offset) % 256 for i in range(n)]


def _reference(loaded, prompt):
    """log_softmax of one dense (cache-free, unchunked) forward: [len(prompt), vocab]."""
    with torch.inference_mode():
        logits = loaded.model.forward_dense(torch.tensor([prompt]))[0]  # [T, vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(entries, loaded, prompt, top_n):
    ref = _reference(loaded, prompt)
    assert len(entries) == len(prompt) - 1
    for pos, entry in enumerate(entries):           # entry pos: prompt token pos+1 given 0..pos
        want = ref[pos]
        assert entry.token_id == prompt[pos + 1]
        assert entry.logprob == pytest.approx(want[prompt[pos + 1]].item(), abs=TOL)
        vals, ids = want.topk(top_n)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(vals.tolist(), abs=TOL)


def test_matches_a_dense_forward_across_prefill_chunks_and_keeps_the_output(tiny):
    prompt = _prompt(75)                             # 5 chunks of the 16-token budget
    plain = run_all(make_core(tiny, max_num_batched_tokens=16, max_num_seqs=4),
                    {"a": prompt}, greedy(12, ignore_eos=True))["a"]
    core = make_core(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    got = run_all(core, {"a": prompt}, greedy(12, ignore_eos=True, prompt_logprobs=5))["a"]
    _check(got["prompt_logprobs"], tiny, prompt, 5)
    assert got["tokens"] == plain["tokens"] and got["text"] == plain["text"]


def test_delivered_once_on_the_first_output(tiny):
    core = make_core(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    prompt = _prompt(40)
    core.add_request(EngineRequest("a", prompt, greedy(4, ignore_eos=True, prompt_logprobs=0), 0.0))
    outputs = []
    while core.has_work:
        outputs += core.step()
    assert [len(o.prompt_logprobs) for o in outputs] == [39, 0, 0, 0]
    assert all(e.top == [] for e in outputs[0].prompt_logprobs)
    single = run_all(core, {"b": prompt}, greedy(1, prompt_logprobs=2))["b"]["final"]
    assert len(single.token_ids) == 1 and len(single.prompt_logprobs) == 39  # first output = last


def test_computes_the_whole_prompt_but_leaves_its_blocks_for_others(tiny):
    core = make_core(tiny, max_num_batched_tokens=32, max_num_seqs=4)
    prompt = _prompt(70)
    warm = run_all(core, {"warm": prompt}, greedy(2, ignore_eos=True))["warm"]["final"]
    assert warm.usage.cached_prompt_tokens == 0
    asked = run_all(core, {"asked": prompt}, greedy(2, ignore_eos=True, prompt_logprobs=1))["asked"]
    assert asked["final"].usage.cached_prompt_tokens == 0      # no prefix-cache reuse for it
    _check(asked["prompt_logprobs"], tiny, prompt, 1)
    other = _prompt(70)[:64] + [1, 2, 3]
    reuse = run_all(core, {"other": other}, greedy(2, ignore_eos=True))["other"]["final"]
    assert reuse.usage.cached_prompt_tokens == 64


def test_mixed_batch(tiny):
    prompts = {"plain": _prompt(50, 1), "two": _prompt(33, 2), "twenty": _prompt(61, 3)}
    params = {"plain": greedy(6, ignore_eos=True), "two": greedy(6, ignore_eos=True, prompt_logprobs=2),
              "twenty": greedy(6, ignore_eos=True, prompt_logprobs=20)}
    alone = {rid: run_all(make_core(tiny, max_num_batched_tokens=24, max_num_seqs=4),
                          {rid: p}, greedy(6, ignore_eos=True))[rid]["tokens"] for rid, p in prompts.items()}
    got = run_all(make_core(tiny, max_num_batched_tokens=24, max_num_seqs=4), prompts, params)
    assert {rid: r["tokens"] for rid, r in got.items()} == alone
    assert got["plain"]["prompt_logprobs"] == []
    _check(got["two"]["prompt_logprobs"], tiny, prompts["two"], 2)
    _check(got["twenty"]["prompt_logprobs"], tiny, prompts["twenty"], 20)


def test_survives_preemption_mid_prefill(tiny):
    # 10 blocks of 16: "a" (100 prompt tokens, grows to 120) squeezes "b" out mid-prefill.
    core = make_core(tiny, num_blocks=10, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = {"a": _prompt(100, 4), "b": _prompt(60, 5)}
    params = {"a": greedy(20, ignore_eos=True), "b": greedy(4, ignore_eos=True, prompt_logprobs=3)}
    got = run_all(core, prompts, params)
    assert core.scheduler.num_preemptions > 0
    _check(got["b"]["prompt_logprobs"], tiny, prompts["b"], 3)
    alone = run_all(make_core(tiny, max_num_batched_tokens=16, max_num_seqs=4), {"b": prompts["b"]},
                    greedy(4, ignore_eos=True))["b"]
    assert got["b"]["tokens"] == alone["tokens"]


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_out_of_range_is_invalid_argument(value):
    with pytest.raises(InvalidArgument, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=value).validate(prompt_len=3, max_model_len=1000, vocab_size=10)
    SamplingParams(prompt_logprobs=20).validate(prompt_len=3, max_model_len=1000, vocab_size=10)
