"""Resuming a request another engine started (request migration, the engine's half): a request
given the first k output tokens of an interrupted run continues it exactly -- same tokens, the
text that was not yet streamed and nothing twice, the same stop, usage counting every token."""
import pytest

from engine_utils import TINY_EOS, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.outputs import EngineRequest
from kvmesh.services.engine.prepare import GenerateInput, RequestPreparer
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.sequence import FinishReason

PROMPT = [(29 * j + 3) % 256 for j in range(21)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _core(tiny):
    return make_core(tiny, speculation="off")


def _run(tiny, params, resume=None):
    return run_all(_core(tiny), {"r": PROMPT}, {"r": params},
                   resume={"r": resume} if resume is not None else None)["r"]


def _assert_continues(whole, k, resumed):
    """`resumed` carries on `whole` after its first k tokens: the client that received whole's
    first k outputs (one token each without speculation) and then `resumed`'s sees whole."""
    assert whole["tokens"][:k] + resumed["tokens"] == whole["tokens"]
    assert "".join(whole["texts"][:k]) + resumed["text"] == whole["text"]
    final, expected = resumed["final"], whole["final"]
    assert (final.finish_reason, final.stop_reason) == (expected.finish_reason, expected.stop_reason)
    assert final.usage.completion_tokens == expected.usage.completion_tokens
    assert final.usage.prompt_tokens == len(PROMPT)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=7, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_the_interrupted_one(tiny, params):
    whole = _run(tiny, params)
    assert len(whole["tokens"]) == 24 and whole["final"].finish_reason is FinishReason.LENGTH
    for k in (1, 5, 13, 23):
        _assert_continues(whole, k, _run(tiny, params, whole["tokens"][:k]))


def test_a_stop_string_split_across_the_interruption_is_still_found_and_cut(tiny):
    free = _run(tiny, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    text = free["text"]
    stop = text[10:13]  # three characters the run produces after its tenth
    assert len(stop) == 3 and text.find(stop) == 10
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,))
    whole = _run(tiny, params)
    assert whole["final"].finish_reason is FinishReason.STOP_STRING and whole["text"] == text[:10]
    held = sum(1 for t in whole["texts"] if t == "")  # outputs whose text was held back
    assert held >= 1
    for k in range(1, len(whole["tokens"])):
        _assert_continues(whole, k, _run(tiny, params, whole["tokens"][:k]))


def test_tokens_that_already_finish_the_request_end_it_without_computing(tiny):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    whole = _run(tiny, params)
    core = _core(tiny)
    done = core.add_request(EngineRequest("r", list(PROMPT), params, 0.0, resume_token_ids=tuple(whole["tokens"])))
    assert done is not None and done.finished and done.token_ids == [] and done.text == ""
    assert done.finish_reason is FinishReason.LENGTH and done.usage.completion_tokens == 6
    assert not core.has_work and core.request_ids() == []
    eos = core.add_request(EngineRequest("e", list(PROMPT), SamplingParams(max_tokens=6, temperature=0.0), 0.0,
                                         resume_token_ids=(whole["tokens"][0], TINY_EOS)))
    assert eos.finish_reason is FinishReason.STOP and eos.stop_reason == str(TINY_EOS)
    assert eos.usage.completion_tokens == 2


@pytest.mark.parametrize("resume, params, match", [
    ((5, 9999), SamplingParams(max_tokens=8), "token id 9999 is outside the vocabulary"),
    (tuple(range(9)), SamplingParams(max_tokens=8), "9 tokens exceed max_tokens"),
    ((5,), SamplingParams(max_tokens=8, prompt_logprobs=1), "prompt_logprobs"),
])
def test_bad_resume_tokens_are_refused_with_what_to_fix(tiny, resume, params, match):
    preparer = RequestPreparer(_core(tiny), start_probe=None)
    with pytest.raises(InvalidArgument, match=match):
        preparer.check(GenerateInput(list(PROMPT), params, resume_token_ids=resume))
