"""SamplingParams.validate: every bad field is refused with a message that says what to fix."""
import math

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.sampling import SamplingParams

LIMITS = dict(prompt_len=10, max_model_len=8192, vocab_size=1000)


def test_defaults_are_valid_greedy_and_frozen():
    params = SamplingParams()
    params.validate(**LIMITS)
    assert params.greedy and params.max_tokens == 256 and params.logprobs is None
    with pytest.raises(AttributeError):
        params.max_tokens = 3


def test_lists_become_tuples_so_params_are_hashable():
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert params.stop == ("a", "b") and params.stop_token_ids == (1, 2)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2)))


def test_context_length_message_says_how_to_fix():
    with pytest.raises(InvalidArgument) as info:
        SamplingParams().validate(prompt_len=9000, max_model_len=8192, vocab_size=1000)
    assert info.value.message == (
        "prompt (9000 tokens) + max_tokens (256) exceeds the model's context length 8192; "
        "shorten the prompt or lower max_tokens"
    )


def test_prompt_plus_max_tokens_may_fill_the_context_exactly():
    SamplingParams(max_tokens=8182).validate(**LIMITS)


@pytest.mark.parametrize(
    "params, limits, match",
    [
        (SamplingParams(), dict(prompt_len=0), "prompt is empty"),
        (SamplingParams(max_tokens=0), {}, "max_tokens must be at least 1, got 0"),
        (SamplingParams(max_tokens=2.5), {}, "max_tokens must be an integer"),
        (SamplingParams(temperature=-0.1), {}, r"temperature must be in \[0, 2\]"),
        (SamplingParams(temperature=2.5), {}, r"temperature must be in \[0, 2\]"),
        (SamplingParams(temperature=math.nan), {}, "temperature must be in .* got nan"),
        (SamplingParams(top_p=0.0), {}, r"top_p must be in \(0, 1\]"),
        (SamplingParams(top_p=1.5), {}, r"top_p must be in \(0, 1\]"),
        (SamplingParams(top_p=math.nan), {}, "top_p must be in .* got nan"),
        (SamplingParams(top_k=-1), {}, "top_k must be >= 0"),
        (SamplingParams(seed=-1), {}, "seed must be in"),
        (SamplingParams(seed=2**64), {}, "seed must be in"),
        (SamplingParams(logprobs=21), {}, "logprobs must be in 0..20"),
        (SamplingParams(logprobs=-1), {}, "logprobs must be in 0..20"),
        (SamplingParams(stop=tuple("abcdefghijklmnopq")), {}, "at most 16 stop strings .* got 17"),
        (SamplingParams(stop=("ok", "")), {}, r"stop\[1\] is empty"),
        (SamplingParams(stop=("x" * 257,)), {}, r"stop\[0\] is 257 characters long; the limit is 256"),
        (SamplingParams(stop_token_ids=(5, 1000)), {},
         r"stop token id 1000 is outside the vocabulary \(0..999\)"),
        (SamplingParams(stop_token_ids=(-1,)), {}, "stop token id -1 is outside"),
    ],
)
def test_invalid_values_are_refused(params, limits, match):
    with pytest.raises(InvalidArgument, match=match):
        params.validate(**{**LIMITS, **limits})


def test_boundary_values_are_accepted():
    SamplingParams(
        temperature=2.0, top_p=1e-6, top_k=1, seed=2**64 - 1, logprobs=20,
        stop=tuple("abcdefghijklmnop"), stop_token_ids=(0, 999),
    ).validate(**LIMITS)
    SamplingParams(stop=("x" * 256,), logprobs=0, seed=0).validate(**LIMITS)
