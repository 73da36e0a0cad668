"""Stop conditions: tokens (eos, stop ids, max_tokens) and stop strings across text deltas."""
import itertools

import pytest

from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.sequence import FinishReason, Sequence
from kvmesh.services.engine.stop import StopStringMatcher, check_stop

EOS = {2}


def after(token, **params):
    seq = Sequence("r", [5, 6], SamplingParams(**params))
    seq.append_token(token)
    return check_stop(seq, token, EOS)


def test_check_stop_on_tokens():
    assert after(7) is None
    assert after(2) is FinishReason.STOP
    assert after(2, ignore_eos=True) is None
    assert after(9, stop_token_ids=(9,)) is FinishReason.STOP
    assert after(9, stop_token_ids=(9,), ignore_eos=True) is FinishReason.STOP
    assert after(7, max_tokens=1) is FinishReason.LENGTH
    assert after(2, max_tokens=1) is FinishReason.STOP  # ended on its own at the limit
    assert after(2, max_tokens=1, ignore_eos=True) is FinishReason.LENGTH


def feed(matcher, deltas):
    return [matcher.feed(d).text for d in deltas]


def test_stop_string_inside_one_delta():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello STOP world") == ("Hello ", "STOP")
    assert m.matched == "STOP" and m.text == "Hello "
    assert m.feed("more") == ("", None) and m.flush() == ""


def test_stop_string_split_across_deltas_is_held_back_then_dropped():
    m = StopStringMatcher(["STOP"])
    assert feed(m, ["Hel", "lo S", "T", "OP and more"]) == ["Hel", "lo ", "", ""]
    assert m.held_back == ""
    assert (m.matched, m.text) == ("STOP", "Hello ")


def test_false_alarm_releases_the_held_back_text():
    m = StopStringMatcher(["STOP"])
    assert feed(m, ["a S", "T", "x"]) == ["a ", "", "STx"]
    assert m.matched is None
    assert feed(m, ["ST"]) == [""]
    assert m.held_back == "ST"
    assert m.flush() == "ST"  # generation ended on eos/length: nothing is lost
    assert m.text == "a STxST"


def test_overlapping_prefix_of_the_stop_string():
    m = StopStringMatcher(["aab"])
    assert feed(m, ["a", "a", "a", "b"]) == ["", "", "a", ""]
    assert (m.matched, m.text) == ("aab", "a")


def test_first_stop_to_complete_wins():
    m = StopStringMatcher(["world", "lo w"])
    assert feed(m, ["hello world"]) == ["hel"]
    assert (m.matched, m.text) == ("lo w", "hel")
    m = StopStringMatcher(["xabc", "ab"])  # "ab" completes first though "xabc" starts first
    assert feed(m, ["xabc"]) == ["x"] and m.matched == "ab"
    m = StopStringMatcher(["b", "ab"])  # equal ends: the earlier start cuts more
    assert feed(m, ["a", "b"]) == ["", ""]
    assert (m.matched, m.text) == ("ab", "")


def test_no_stop_strings_emits_everything():
    m = StopStringMatcher([])
    assert feed(m, ["a", "bc"]) == ["a", "bc"]
    assert m.flush() == "" and m.text == "abc"


@pytest.mark.parametrize(
    "stops, text",
    [
        (["STOP"], "Hello STOP world"),
        (["\n\n", "User:"], "answer\nmore\n\nUser: hi"),
        (["aab", "b"], "xaaab"),
        (["world", "lo w"], "hello world"),
        (["xyz"], "no match here xy"),
    ],
)
def test_result_does_not_depend_on_how_the_text_is_split(stops, text):
    whole = StopStringMatcher(stops)
    expected_emitted = whole.feed(text).text + whole.flush()
    for cuts in itertools.combinations(range(1, len(text)), 2):
        parts = [text[i:j] for i, j in zip((0, *cuts), (*cuts, len(text)))]
        m = StopStringMatcher(stops)
        emitted = "".join(feed(m, parts)) + m.flush()
        assert (emitted, m.text, m.matched) == (expected_emitted, whole.text, whole.matched), parts
    for size in (1, 2, 3):
        m = StopStringMatcher(stops)
        emitted = "".join(feed(m, [text[i : i + size] for i in range(0, len(text), size)])) + m.flush()
        assert (emitted, m.matched) == (expected_emitted, whole.matched)


def test_text_fed_unchecked_never_ends_the_output_but_can_start_a_stop_string():
    """min_tokens (vLLM's rule): no stop string may end in the text of the first min_tokens
    tokens; one that starts there and ends after them does stop, cut at its start."""
    m = StopStringMatcher(["ab"])
    assert m.feed("xab", check=False) == ("xab", None)  # a whole match inside: plain text
    assert m.feed("a", check=False) == ("", None)  # a possible beginning is held back as usual
    assert m.feed("b") == ("", "ab")  # completes after the boundary: stops, cut at its start
    assert m.text == "xab"
    m = StopStringMatcher(["ab"])
    assert feed(m, ["xa"]) == ["x"] and m.feed("b", check=False) == ("ab", None)
    assert m.feed("cab") == ("c", "ab") and m.text == "xabc"
