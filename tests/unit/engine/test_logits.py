"""Logits processing (services/engine/logits.py) and min_p, each against a hand-computed
expectation; greedy verification of drafts with penalties equals plain decoding with them."""
import math

import pytest
import torch

from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.logits import LogitsProcessor, Processing, RowContext, unpack_bitmask
from kvmesh.services.engine.sampler import Sampler, apply_min_p
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.speculation import verify_batch

EOS = 5
NEG_INF = float("-inf")


def _process(logits, params, prompt=(), output=(), allowed=None):
    row = RowContext(params, list(prompt), list(output))
    return LogitsProcessor([EOS])(torch.tensor([logits]), [row], allowed)[0].tolist()


def test_presence_and_frequency_penalties_follow_openai():
    # token 1 generated twice, token 2 once, token 3 only in the prompt (not penalized)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = _process([1.0, 2.0, 3.0, 4.0, 0.0, 0.0], params, prompt=[3, 3], output=[1, 2, 1])
    assert got == pytest.approx([1.0, 2.0 - 0.5 - 2 * 0.25, 3.0 - 0.5 - 0.25, 4.0, 0.0, 0.0])


def test_negative_penalties_encourage_repeats():
    got = _process([0.0] * 6, SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), output=[4, 4])
    assert got == pytest.approx([0, 0, 0, 0, 2.0, 0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    params = SamplingParams(repetition_penalty=2.0)
    got = _process([4.0, -4.0, 4.0, -4.0, 4.0, 1.0], params, prompt=[0, 1], output=[2, 3, 2])
    assert got == pytest.approx([2.0, -8.0, 2.0, -8.0, 4.0, 1.0])  # tokens 4, 5 never seen


def test_logit_bias_is_added_and_combines_with_penalties_in_vllms_order():
    params = SamplingParams(logit_bias={1: 3.0, 4: -100.0}, repetition_penalty=2.0)
    # bias first (1 + 3 = 4), then the repetition penalty halves it (token 1 was generated)
    got = _process([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], params, output=[1])
    assert got == pytest.approx([1.0, 2.0, 1.0, 1.0, -99.0, 1.0])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=3, stop_token_ids=(2,))
    logits = [0.0, 1.0, 9.0, 0.0, 0.0, 10.0]
    assert _process(logits, params, output=[0, 0]) == [0.0, 1.0, NEG_INF, 0.0, 0.0, NEG_INF]
    assert _process(logits, params, output=[0, 0, 0]) == logits
    ignoring = SamplingParams(min_tokens=3, ignore_eos=True)  # eos does not stop: not masked
    assert _process(logits, ignoring, output=[]) == logits


def test_grammar_mask_wins_over_min_tokens_when_only_the_end_is_allowed():
    params = SamplingParams(min_tokens=4, presence_penalty=0.0)
    allowed = torch.zeros(1, 6, dtype=torch.bool)
    allowed[0, EOS] = True
    got = _process([1.0] * 6, params, allowed=allowed)
    assert got == [NEG_INF] * 5 + [1.0]
    allowed[0, 3] = True  # another way on: min_tokens applies
    assert _process([1.0] * 6, params, allowed=allowed) == [NEG_INF] * 3 + [1.0, NEG_INF, NEG_INF]


def test_rows_without_processing_are_untouched_and_not_copied():
    logits = torch.randn(2, 6)
    rows = [RowContext(SamplingParams(), [1], []), RowContext(SamplingParams(top_k=3), [1], [])]
    assert LogitsProcessor([EOS])(logits, rows) is logits


def test_bitmask_unpacks_bit_b_of_word_w_as_token_32w_plus_b():
    bitmask = torch.tensor([[0b101, -(1 << 31), 1]], dtype=torch.int32)  # -2**31: bit 31 alone
    allowed = unpack_bitmask(bitmask, 65)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 2, 63, 64]


def test_min_p_drops_tokens_below_a_share_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = apply_min_p(logits, torch.tensor([0.25]))[0]  # floor 0.125: drops only 0.05
    assert torch.isinf(kept).tolist() == [False, False, False, True]
    assert apply_min_p(logits, torch.tensor([0.0]))[0].tolist() == logits[0].tolist()


def test_greedy_sampler_takes_the_argmax_after_processing_and_logprobs_before():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(frequency_penalty=2.0, logprobs=0)
    processing = Processing(LogitsProcessor([EOS]), [RowContext(params, [0], [1])])
    out = Sampler()(logits, [params], [None], processing)
    assert out.token_ids == [2]  # 3 - 2 = 1 < 2
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


def test_sampler_refuses_processing_params_without_histories():
    with pytest.raises(ValueError, match="no row histories"):
        Sampler()(torch.zeros(1, 6), [SamplingParams(presence_penalty=1.0)], [None])


def test_verified_drafts_with_penalties_equal_plain_decoding_with_them():
    """A "model" whose logits never change: only the penalties move the argmax, so the plain
    output walks through the tokens; verification of that output as drafts accepts it all, and a
    draft that plain decoding would not pick is rejected where it would not."""
    torch.manual_seed(0)
    base = torch.randn(12)
    params = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    prompt, plain = [0, 1], []
    for _ in range(6):
        rows = Processing(LogitsProcessor([EOS]), [RowContext(params, prompt, list(plain))])
        plain.append(Sampler()(base[None], [params], [None], rows).token_ids[0])
    assert len(set(plain)) > 1, "the penalties should move the argmax"
    drafts = tuple(plain[1:])
    contexts = [RowContext(params, prompt, plain[:1] + list(drafts[:j])) for j in range(len(drafts) + 1)]
    logits = base.repeat(len(drafts) + 1, 1)
    verdict = verify_batch([logits], [drafts], [params], [None], [1],
                           Processing(LogitsProcessor([EOS]), contexts))[0]
    assert verdict.num_accepted == len(drafts)
    wrong = (plain[1], (plain[2] + 1) % 12, plain[3])
    contexts = [RowContext(params, prompt, plain[:1] + list(wrong[:j])) for j in range(4)]
    verdict = verify_batch([base.repeat(4, 1)], [wrong], [params], [None], [1],
                           Processing(LogitsProcessor([EOS]), contexts))[0]
    assert (verdict.num_accepted, verdict.token_ids) == (1, [plain[1], plain[2]])


@pytest.mark.parametrize("field, value, fix", [
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", math.nan, "[-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"), ("min_p", 1.5, "[0, 1]"), ("min_tokens", 300, "0..max_tokens"),
    ("logit_bias", {3: 101.0}, "[-100, 100]"), ("logit_bias", {99: 1.0}, "outside the vocabulary"),
])
def test_validation_says_what_to_fix(field, value, fix):
    with pytest.raises(InvalidArgument, match=field.split("_")[0]) as e:
        SamplingParams(**{field: value}).validate(prompt_len=1, max_model_len=2048, vocab_size=50)
    assert fix in e.value.message
