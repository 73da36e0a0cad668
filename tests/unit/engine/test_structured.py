"""Structured output in the engine on the tiny byte-level model: every output is in the
constraint's language, whatever the random weights prefer; with speculative decoding the greedy
output is plain decoding's and a draft the grammar forbids is rejected; a resumed request's
grammar state is replayed; a constraint that does not compile is InvalidArgument."""
import json
import re

import pytest

from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint, oracle_drafts, run_all
from kvmesh.errors import InvalidArgument
from kvmesh.services.engine.sampling import Constraint, ConstraintKind, SamplingParams
from kvmesh.services.engine.sequence import FinishReason

K = 4
REGEX = r"[a-c]{2,6}-[0-9]{1,3}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["x", "yz"]}},
          "required": ["ok", "pick"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def fake():
    service = FakeDraftService()
    yield service
    service.stop()


def _prompts(n):
    return {f"r{i}": [(11 * i + 5 * j + 2) % 256 for j in range(9 + 4 * i)] for i in range(n)}


def _regex(**kw):
    return greedy(24, constraint=Constraint(ConstraintKind.REGEX, REGEX), **kw)


def test_regex_choice_and_schema_outputs_are_in_their_language(tiny):
    prompts = _prompts(6)
    params = {
        "r0": _regex(), "r1": _regex(presence_penalty=1.0),
        "r2": greedy(24, constraint=Constraint(ConstraintKind.CHOICE, choices=("alpha", "beta", "be"))),
        "r3": greedy(40, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))),
        "r4": SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                             constraint=Constraint(ConstraintKind.REGEX, REGEX)),
        "r5": greedy(8),  # unconstrained in the same batch
    }
    out = run_all(make_core(tiny), prompts, params)
    for rid in ("r0", "r1", "r4"):
        assert re.fullmatch(REGEX, out[rid]["text"]), out[rid]["text"]
        assert out[rid]["final"].finish_reason is FinishReason.STOP
    assert out["r2"]["text"] in ("alpha", "beta", "be")
    value = json.loads(out["r3"]["text"])
    assert set(value) == {"ok", "pick"} and isinstance(value["ok"], bool) and value["pick"] in ("x", "yz")
    assert len(out["r5"]["tokens"]) == 8


def test_speculation_with_a_grammar_gives_plain_decodings_tokens(tiny, fake):
    prompts = _prompts(3)
    params = {"r0": _regex(), "r1": _regex(frequency_penalty=0.7),
              "r2": greedy(40, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))}
    plain = run_all(make_core(tiny), prompts, params)
    outputs = {r: v["tokens"] for r, v in plain.items()}
    for wrong_at in (None, {1}, {0, 2}):
        fake.propose = oracle_drafts(prompts, outputs, wrong_at)
        core = make_core(tiny, draft_address=fake.address, draft_timeout_s=5.0, speculation="ngram",
                         spec_max_draft_tokens=K, spec_step_rows=256)
        got = run_all(core, prompts, params)
        assert {r: v["tokens"] for r, v in got.items()} == outputs
        if wrong_at is None:
            assert sum(v["final"].spec.accepted_tokens for v in got.values()) > 0


def test_a_draft_the_grammar_forbids_is_rejected(tiny, fake):
    """The drafts continue with "!", which the regex never allows: each step accepts nothing and
    emits the target's own (grammar-masked) token."""
    prompts = {"r0": _prompts(1)["r0"]}
    params = _regex()
    plain = run_all(make_core(tiny), prompts, params)
    fake.propose = lambda rid, history, k: [ord("!")] * k
    core = make_core(tiny, draft_address=fake.address, draft_timeout_s=5.0, speculation="ngram",
                     spec_max_draft_tokens=K, spec_step_rows=256)
    got = run_all(core, prompts, params)
    assert got["r0"]["tokens"] == plain["r0"]["tokens"]
    spec = got["r0"]["final"].spec
    assert spec.steps > 0 and spec.accepted_tokens == 0


def test_a_resumed_request_replays_its_grammar_state(tiny):
    prompts = _prompts(1)
    whole = run_all(make_core(tiny), prompts, _regex())["r0"]["tokens"]
    resumed = run_all(make_core(tiny), prompts, _regex(), resume={"r0": whole[:3]})["r0"]["tokens"]
    assert resumed == whole[3:]


@pytest.mark.parametrize("constraint, message", [
    (Constraint(ConstraintKind.REGEX, "a(b"), "unclosed group"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "foo"}'), "foo"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "{"), "not valid JSON"),
    (Constraint(ConstraintKind.CHOICE, choices=()), "at least one choice"),
])
def test_a_constraint_that_does_not_compile_is_invalid_argument(tiny, constraint, message):
    with pytest.raises(InvalidArgument, match=message):
        make_core(tiny).validate([1, 2, 3], greedy(8, constraint=constraint))
