"""The full sampling set on the real model, token by token: the engine's greedy output with each
penalty or extra equals a reference decoder that runs Hugging Face's model on the whole prefix at
every step and applies the parameter's definition by hand (OpenAI's presence/frequency penalties
over generated tokens, vLLM's repetition penalty over prompt + generated tokens, logit_bias,
min_tokens, stop_token_ids, ignore_eos). Also: top_k=1 and min_p=1 sample the argmax, the prefix
cache never changes a penalized answer, and speculative decoding with a grammar and penalties
gives plain decoding's tokens."""
from __future__ import annotations

import json

import pytest
import torch

from engine_utils import FakeDraftService, greedy, make_core, oracle_drafts, run_all
from kvmesh.services.engine.sampling import Constraint, ConstraintKind, SamplingParams
from kvmesh.services.engine.sequence import FinishReason

pytestmark = pytest.mark.slow

N = 24


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered)


def _definition(logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int], eos: int) -> torch.Tensor:
    """The parameters' definitions, one token at a time (no batching, no tensors tricks)."""
    logits = logits.clone()
    if len(out) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else [eos]):
            logits[t] = float("-inf")
    for t, b in p.logit_bias:
        logits[t] += b
    for t in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            x = logits[t].item()
            logits[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t in set(out):
        logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return logits


def _reference(hf, prompt: list[int], p: SamplingParams, eos: int) -> tuple[list[int], str]:
    out: list[int] = []
    while len(out) < p.max_tokens:
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
        token = int(_definition(logits, p, prompt, out, eos).argmax())
        out.append(token)
        if (token == eos and not p.ignore_eos) or token in p.stop_token_ids:
            return out, "stop"
    return out, "length"


@pytest.fixture(scope="module")
def prompts(bundled_model):
    tok = bundled_model.tokenizer
    return {"list": _chat_ids(tok, "List the days of the week, separated by commas."),
            "yes": _chat_ids(tok, "Answer with one word: is water wet?")}


def test_each_penalty_and_extra_matches_its_definition_token_by_token(bundled_model, hf_bundled_model, prompts):
    eos = bundled_model.config.eos_token_ids[0]
    core = make_core(bundled_model)
    base = run_all(core, prompts, greedy(N))
    first, day = base["list"]["tokens"][0], base["list"]["tokens"][2]
    short = base["yes"]["tokens"]
    assert short[-1] == eos and len(short) < N, "the 'yes' prompt should end early on its own"
    cases = {
        "presence": ("list", greedy(N, presence_penalty=2.0)),
        "frequency": ("list", greedy(N, frequency_penalty=2.0)),
        "repetition": ("list", greedy(N, repetition_penalty=1.5)),
        "bias": ("list", greedy(N, logit_bias={first: -100.0, day: 4.0})),
        "min_tokens": ("yes", greedy(N, min_tokens=len(short) + 3)),
        "stop_ids": ("list", greedy(N, stop_token_ids=(base["list"]["tokens"][3],))),
        "ignore_eos": ("yes", greedy(len(short) + 3, ignore_eos=True)),
    }
    got = run_all(make_core(bundled_model), {name: prompts[which] for name, (which, _) in cases.items()},
                  {name: p for name, (_, p) in cases.items()})
    for name, (which, params) in cases.items():
        want, reason = _reference(hf_bundled_model, prompts[which], params, eos)
        assert got[name]["tokens"] == want, name
        assert got[name]["final"].finish_reason is FinishReason(reason), name
        if name not in ("stop_ids",):
            assert want != (base[which]["tokens"] + [None] * N)[:len(want)], f"{name} changed nothing"
    assert first not in got["bias"]["tokens"]
    assert len(got["min_tokens"]["tokens"]) > len(short)
    assert got["ignore_eos"]["tokens"][:len(short)] == short


def test_top_k_1_and_min_p_1_sample_the_argmax(bundled_model, prompts):
    base = run_all(make_core(bundled_model), {"p": prompts["list"]}, greedy(N))["p"]["tokens"]
    params = {"k": SamplingParams(max_tokens=N, temperature=1.5, top_k=1, seed=1),
              "m": SamplingParams(max_tokens=N, temperature=1.5, min_p=1.0, seed=2)}
    got = run_all(make_core(bundled_model), {"k": prompts["list"], "m": prompts["list"]}, params)
    assert got["k"]["tokens"] == base and got["m"]["tokens"] == base


def test_the_prefix_cache_never_changes_a_penalized_answer(bundled_model, prompts):
    core = make_core(bundled_model)
    params = greedy(N, frequency_penalty=1.0, repetition_penalty=1.2)
    cold = run_all(core, {"a": prompts["list"]}, params)["a"]
    warm = run_all(core, {"b": prompts["list"]}, params)["b"]
    assert warm["final"].usage.cached_prompt_tokens > 0
    assert warm["tokens"] == cold["tokens"]


def test_speculation_with_grammar_and_penalties_gives_plain_decodings_tokens(bundled_model, prompts):
    schema = {"type": "object", "properties": {"day": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}},
              "required": ["day", "n"], "additionalProperties": False}
    params = {"a": greedy(24, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))),
              "b": greedy(24, constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)),
                          presence_penalty=0.8)}
    ids = {"a": prompts["list"], "b": prompts["list"]}
    plain = run_all(make_core(bundled_model), ids, params)
    fake = FakeDraftService()
    try:
        for wrong_at in (None, {1}):
            fake.propose = oracle_drafts(ids, {r: v["tokens"] for r, v in plain.items()}, wrong_at)
            core = make_core(bundled_model, draft_address=fake.address, draft_timeout_s=5.0,
                             speculation="ngram", spec_max_draft_tokens=4, spec_step_rows=256)
            got = run_all(core, ids, params)
            for r in ids:
                assert got[r]["tokens"] == plain[r]["tokens"], (r, wrong_at)
                if got[r]["final"].finish_reason is FinishReason.STOP:
                    json.loads(got[r]["text"])
            assert sum(v["final"].spec.accepted_tokens for v in got.values()) > 0
    finally:
        fake.stop()
