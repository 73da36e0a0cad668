"""kvmesh.limits: the gateway and the engine refuse a request at the same bounds, since both read
them from one place (a request the gateway passes is never refused by the engine for a range)."""
import pytest

from kvmesh import limits
from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.gateway.errors import ApiError
from kvmesh.services.gateway.spec import ChatTurn, GenerationRequest, Limits, Sampling, validate_request

CONTEXT = dict(prompt_len=4, max_model_len=4096, vocab_size=100)


def _gateway(sampling: Sampling, n: int = 1) -> None:
    validate_request(GenerationRequest("chat", "m", sampling, messages=(ChatTurn("user", "q"),), n=n),
                     Limits(max_n=n))


@pytest.mark.parametrize("field, at, past", [
    ("temperature", limits.MAX_TEMPERATURE, limits.MAX_TEMPERATURE + 0.01),
    ("logprobs", limits.MAX_LOGPROBS, limits.MAX_LOGPROBS + 1),
    ("stop", ("s",) * limits.MAX_STOP_STRINGS, ("s",) * (limits.MAX_STOP_STRINGS + 1)),
    ("stop", ("x" * limits.MAX_STOP_STRING_CHARS,), ("x" * (limits.MAX_STOP_STRING_CHARS + 1),)),
])
def test_gateway_and_engine_share_each_sampling_limit(field, at, past):
    _gateway(Sampling(**{field: at}))
    SamplingParams(**{field: at}).validate(**CONTEXT)
    with pytest.raises(ApiError):
        _gateway(Sampling(**{field: past}))
    with pytest.raises(InvalidArgument):
        SamplingParams(**{field: past}).validate(**CONTEXT)


def test_every_choice_of_a_seed_the_gateway_passes_on_is_a_seed_the_engine_takes():
    n = 4  # choice i samples with seed + i
    top = limits.MAX_SEED - n
    _gateway(Sampling(seed=top), n)
    for i in range(n):
        SamplingParams(seed=top + i).validate(**CONTEXT)
    with pytest.raises(ApiError):
        _gateway(Sampling(seed=top + 1), n)
    with pytest.raises(InvalidArgument):
        SamplingParams(seed=limits.MAX_SEED + 1).validate(**CONTEXT)
