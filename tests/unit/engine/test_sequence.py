"""Sequence: token bookkeeping under the one-token-budget model."""
from kvmesh.services.engine.sequence import FinishReason, Sequence, SequenceStatus


def test_token_properties_and_append():
    seq = Sequence("r", [1, 2, 3])
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (3, 3, 0)
    assert seq.last_token_id == 3 and seq.status is SequenceStatus.WAITING
    seq.append_token(7)
    seq.append_token(8)
    assert seq.all_token_ids == [1, 2, 3, 7, 8]
    assert seq.last_token_id == 8 and seq.num_tokens == 5
    assert seq.prompt_token_ids == [1, 2, 3]


def test_token_slices_match_all_token_ids():
    seq = Sequence("r", [1, 2, 3, 4])
    for t in (5, 6, 7):
        seq.append_token(t)
    for start in range(8):
        for end in range(start, 8):
            assert seq.token_ids(start, end) == seq.all_token_ids[start:end]


def test_needs_sampling_when_every_known_token_is_computed():
    seq = Sequence("r", [1, 2, 3])
    assert not seq.needs_sampling
    seq.num_computed_tokens = 3
    assert seq.needs_sampling
    seq.append_token(4)
    assert not seq.needs_sampling


def test_identity_semantics_and_finish_reason_strings():
    a, b = Sequence("r", [1]), Sequence("r", [1])
    assert a != b and len({a, b}) == 2
    assert FinishReason.STOP_STRING == "stop_string" and FinishReason.LENGTH == "length"
    assert str(FinishReason.STOP) == f"{FinishReason.STOP}" == "stop"
    assert {"abort": 3}[FinishReason.ABORT] == 3
