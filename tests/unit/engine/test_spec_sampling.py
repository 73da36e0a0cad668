"""Sampled requests with speculation: the acceptance rule keeps the target's distribution.

Exact reference: the tiny model's own distribution of the first four generated tokens (dense
forwards over every prefix in the top-k support), against which both plain sampling and
speculative sampling (drafts that are sometimes right, sometimes wrong) are tested with a
chi-square goodness-of-fit test over N seeded requests. Seeds are fixed, so the test is
deterministic; the tolerance is a p-value of 1e-3 (a correct sampler fails it for one seed set
in a thousand), and per position a total-variation distance from the exact marginal of at most
twice its expected sampling noise, 0.5 * sum_t 2 * sqrt(p_t (1 - p_t) / N) (0.03-0.1 here).
"""
import math
from collections import Counter

import pytest
import torch

from engine_utils import FakeDraftService, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.services.engine.sampler import Draws, sampling_probs
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.speculation import verify, verify_batch

PROMPT = [(13 * j + 7) % 256 for j in range(12)]
TOKENS = 4          # generated per request: t1 from the prefill, then drafts for t2 and t3, bonus t4
N = 2000            # requests (seeds 0..N-1)
P_VALUE = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _params(seed=None, max_tokens=TOKENS):
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=4, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def exact(tiny):
    """{continuation prefix (tuple) -> next-token distribution [vocab]} for every prefix of
    length 0..TOKENS-1 with nonzero probability, and the exact joint {tokens: prob}."""
    dist, joint = {}, {(): 1.0}
    params = _params()
    with torch.inference_mode():
        for _ in range(TOKENS):
            prefixes = list(joint)
            ids = torch.tensor([PROMPT + list(p) for p in prefixes])          # [B, T]
            logits = tiny.model.forward_dense(ids)[:, -1]                     # [B, vocab]
            probs = sampling_probs(logits, [params] * len(prefixes))          # [B, vocab]
            nxt = {}
            for prefix, row in zip(prefixes, probs):
                dist[prefix] = row
                for t in row.nonzero().flatten().tolist():
                    nxt[prefix + (t,)] = joint[prefix] * row[t].item()
            joint = nxt
    return dist, joint


def _drafts_sometimes_right(dist):
    """Drafts by rank under the target: the most likely token, then the second most likely."""
    def propose(rid, history, k):
        prefix = tuple(history[len(PROMPT):])
        out = []
        for rank in (0, 1)[:k]:
            row = dist.get(prefix)
            if row is None:
                break
            token = row.topk(2).indices[rank].item()
            out.append(token)
            prefix += (token,)
        return out
    return propose


def _chi_square(samples: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, cells with expected count < 5 pooled."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e, o = p * n, samples.get(key, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, cells = stat + (o - e) ** 2 / e, cells + 1
    assert sum(samples.values()) == n and all(k in expected for k in samples), "impossible outputs"
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    return stat, cells - 1


def _check(outputs: list[tuple[int, ...]], joint: dict) -> None:
    stat, df = _chi_square(Counter(outputs), joint, len(outputs))
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)).item()
    assert p_value > P_VALUE, f"chi-square {stat:.1f} with {df} df: p = {p_value:.2e}"
    for pos in range(TOKENS):
        marginal = Counter()
        for key, p in joint.items():
            marginal[key[pos]] += p
        seen = Counter(o[pos] for o in outputs)
        tv = 0.5 * sum(abs(seen.get(t, 0) / len(outputs) - p) for t, p in marginal.items())
        bound = 0.5 * sum(2 * math.sqrt(p * (1 - p) / len(outputs)) for p in marginal.values())
        assert tv < bound, f"position {pos}: total variation {tv:.3f} (bound {bound:.3f})"


def _sample(core) -> list[tuple[int, ...]]:
    prompts = {f"s{i}": PROMPT for i in range(N)}
    params = {f"s{i}": _params(seed=i) for i in range(N)}
    results = run_all(core, prompts, params)
    return [tuple(results[f"s{i}"]["tokens"]) for i in range(N)], results


def _core(tiny, **kw):
    return make_core(tiny, max_num_seqs=128, max_num_batched_tokens=512, max_waiting=N,
                     enable_prefix_caching=False, **kw)


# Not the deployment's speculation: every request drafts (no SpecGate) and every sequence of a
# batch gets its drafts (no row budget), so the acceptance rule is exercised on every step.
SPEC = dict(draft_timeout_s=5.0, speculation="ngram", spec_max_draft_tokens=2, spec_step_rows=256)


def test_plain_sampling_matches_the_exact_distribution(tiny, exact):
    """Checks the reference (and the test's power) on the sampler speculation must match."""
    outputs, _ = _sample(_core(tiny))
    _check(outputs, exact[1])


def test_speculative_sampling_matches_the_exact_distribution(tiny, exact):
    fake = FakeDraftService(_drafts_sometimes_right(exact[0]))
    try:
        core = _core(tiny, draft_address=fake.address, **SPEC)
        outputs, results = _sample(core)
    finally:
        fake.stop()
    _check(outputs, exact[1])
    totals = core.spec_totals
    # both branches ran often: accepted drafts (t3 and t4 reached through them) and rejections
    assert totals.draft_tokens >= 2 * N and 0.2 < totals.accepted_tokens / totals.draft_tokens < 0.9
    bonus = sum(r["final"].spec.accepted_tokens == 2 for r in results.values())
    assert bonus > 100


def test_a_seed_reproduces_the_output_under_the_same_drafts(tiny, exact):
    fake = FakeDraftService(_drafts_sometimes_right(exact[0]))
    try:
        runs = []
        for _ in range(2):
            core = make_core(tiny, draft_address=fake.address, **SPEC)
            prompts = {f"s{i}": PROMPT for i in range(20)}
            got = run_all(core, prompts, {f"s{i}": _params(seed=100 + i, max_tokens=12) for i in range(20)})
            runs.append({r: v["tokens"] for r, v in got.items()})
            assert core.spec_totals.draft_tokens > 0  # drafts were verified, not skipped
    finally:
        fake.stop()
    assert runs[0] == runs[1]


def test_verify_rule_on_a_known_distribution():
    """Rows by hand: p = (0.5, 0.3, 0.2), then (0.1, 0.1, 0.8). A draft of token 1 is accepted
    with probability 0.3; on rejection the token is 0 or 2 in proportion 5:2. N sequences are
    verified in one batch (each with its own seed), greedy ones mixed in."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))  # [k + 1 = 2, vocab = 3]
    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    n = 20000
    params = [sampled if i % 10 else greedy for i in range(n)]
    draws = [Draws(i) if p is sampled else None for i, p in enumerate(params)]
    verdicts = verify_batch([logits] * n, [(1,)] * n, params, draws, [0] * n)
    first = Counter(v.token_ids[0] for v, p in zip(verdicts, params) if p is sampled)
    m = sum(first.values())
    assert first[1] / m == pytest.approx(0.3, abs=0.015)
    assert first[0] / m == pytest.approx(0.5, abs=0.015) and first[2] / m == pytest.approx(0.2, abs=0.015)
    # after an accepted draft, the bonus token comes from the second row
    bonus = Counter(v.token_ids[1] for v, p in zip(verdicts, params) if p is sampled and v.num_accepted == 1)
    assert bonus[2] / sum(bonus.values()) == pytest.approx(0.8, abs=0.03)
    # greedy: the longest prefix equal to the argmax, then the argmax
    assert {tuple(v.token_ids) for v, p in zip(verdicts, params) if p is greedy} == {(0,)}
    assert verify(logits, [0], greedy, None).token_ids == [0, 2]
    # a draft outside top-k has p = 0: always rejected, the token comes from p itself
    topk = SamplingParams(temperature=1.0, top_k=2)
    outs = verify_batch([logits] * 2000, [(2,)] * 2000, [topk] * 2000, [Draws(n + i) for i in range(2000)], [0] * 2000)
    assert {v.token_ids[0] for v in outs} == {0, 1} and all(v.num_accepted == 0 for v in outs)


def test_a_seed_gives_the_same_output_with_and_without_speculation(tiny, exact):
    """Verification samples output position n with the generator plain decoding uses at n (see
    speculation's NOTE), so drafts change the speed, not the tokens."""
    prompts = {f"s{i}": PROMPT for i in range(200)}
    params = {f"s{i}": _params(seed=500 + i, max_tokens=12) for i in range(200)}
    plain = run_all(_core(tiny), prompts, params)
    fake = FakeDraftService(_drafts_sometimes_right(exact[0]))
    try:
        core = _core(tiny, draft_address=fake.address, **SPEC)
        spec = run_all(core, prompts, params)
    finally:
        fake.stop()
    assert core.spec_totals.accepted_tokens > 0 and core.spec_totals.draft_tokens > core.spec_totals.accepted_tokens
    assert {r: v["tokens"] for r, v in spec.items()} == {r: v["tokens"] for r, v in plain.items()}
