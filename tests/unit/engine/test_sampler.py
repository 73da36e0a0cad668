"""Sampler: greedy, per-request seeded streams, exact top-k/top-p masks, logprobs."""
import math

import pytest
import torch

from kvmesh.services.engine.sampler import Draws, Sampler, apply_top_k_top_p, make_draws, position_seed
from kvmesh.services.engine.sampling import SamplingParams

NEG_INF = float("-inf")
VOCAB = 50


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: with a busy shared CPU, OpenMP barriers cost ~8 ms per op on 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Request:
    """Params plus the Draws a request keeps for its lifetime and its output position (as
    EngineCore does: one draw per generated token)."""

    def __init__(self, **params):
        self.params = SamplingParams(**params)
        self.draws = make_draws(self.params)
        self.position = 0

    def generator(self):
        generator = self.draws.at(self.position) if self.draws is not None else None
        self.position += 1
        return generator


def sample(sampler, logits, requests):
    return sampler(logits, [r.params for r in requests], [r.generator() for r in requests])


def random_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_for_every_row():
    logits = random_logits(8)
    requests = [Request() for _ in range(8)]
    assert all(r.draws is None for r in requests)
    out = sample(Sampler(), logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_mask_is_exact():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0], [1.0, 4.0, 2.0, 3.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert out.tolist() == [[NEG_INF, 4.0, NEG_INF, 3.0], [1.0, 4.0, 2.0, 3.0]]


def test_top_k_ties_break_by_token_id():
    logits = torch.tensor([[2.0, 5.0, 5.0, 5.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert out.tolist() == [[NEG_INF, 5.0, 5.0, NEG_INF]]


@pytest.mark.parametrize(
    "top_k, top_p, kept",
    [
        (0, 0.4, [0]),           # mass before token 1 is 0.5 >= 0.4
        (0, 0.7, [0, 1]),        # 0.5 < 0.7, then 0.75 >= 0.7
        (0, 0.8, [0, 1, 2]),
        (0, 1.0, [0, 1, 2, 3]),
        (3, 0.8, [0, 1]),        # top-k first: renormalized [4/7, 2/7, 1/7]; 6/7 >= 0.8
        (1, 1.0, [0]),
    ],
)
def test_top_p_mask_is_exact_and_applies_after_top_k(top_k, top_p, kept):
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    out = apply_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == kept
    assert torch.equal(out[0, kept], logits[0, kept])


def test_each_row_gets_its_own_k_and_p():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3).log()
    out = apply_top_k_top_p(logits, torch.tensor([2, 0, 3]), torch.tensor([1.0, 0.4, 0.8]))
    assert torch.isfinite(out).tolist() == [
        [True, True, False, False],
        [True, False, False, False],
        [True, True, False, False],
    ]


def test_seeded_sampling_is_independent_of_batch_composition():
    target_row = random_logits(1, seed=1)[0]

    def stream(num_neighbours):
        target = Request(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
        neighbours = [Request(temperature=1.5, top_p=0.9, seed=i) for i in range(num_neighbours)]
        neighbours.append(Request())  # a greedy one
        sampler = Sampler()
        tokens = []
        for step in range(30):
            batch = neighbours[: step % (len(neighbours) + 1)]
            position = step % (len(batch) + 1)
            rows = batch[:position] + [target] + batch[position:]
            logits = random_logits(len(rows), seed=100 + step)
            logits[position] = target_row
            tokens.append(sample(sampler, logits, rows).token_ids[position])
        return tokens

    alone = stream(0)
    assert stream(3) == alone
    assert stream(5) == alone
    assert len(set(alone)) > 1  # really sampled, not argmax


def test_same_seed_same_stream_different_seed_different_stream():
    logits = random_logits(1, seed=2)

    def draws(seed):
        request = Request(temperature=1.0, seed=seed)
        sampler = Sampler()
        return [sample(sampler, logits, [request]).token_ids[0] for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_the_stream_belongs_to_the_request_not_the_sampler():
    logits = random_logits(1, seed=3)
    request = Request(temperature=1.0, seed=3)
    first = [sample(Sampler(), logits, [request]).token_ids[0] for _ in range(5)]
    rest = [sample(Sampler(), logits, [request]).token_ids[0] for _ in range(5)]
    fresh = Request(temperature=1.0, seed=3)
    assert [sample(Sampler(), logits, [fresh]).token_ids[0] for _ in range(10)] == first + rest


def test_a_draw_depends_on_the_seed_and_the_position_only():
    """What request migration relies on: a request continued elsewhere from output position 12,
    with the same seed, draws what the uninterrupted one draws there."""
    logits = random_logits(1, seed=6)
    whole = Request(temperature=1.0, seed=99)
    tokens = [sample(Sampler(), logits, [whole]).token_ids[0] for _ in range(20)]
    resumed = Request(temperature=1.0, seed=99)
    resumed.position = 12
    assert [sample(Sampler(), logits, [resumed]).token_ids[0] for _ in range(8)] == tokens[12:]
    assert len(set(tokens)) > 1


def test_position_seeds_do_not_collide_for_neighbouring_seeds_and_positions():
    seeds = {position_seed(seed, pos) for seed in range(64) for pos in range(64)}
    assert len(seeds) == 64 * 64
    assert all(0 <= s < 2 ** 64 for s in seeds)
    assert Draws(5).at(3).initial_seed() == position_seed(5, 3)


def test_unseeded_sampling_works():
    out = sample(Sampler(), random_logits(2), [Request(temperature=1.0), Request(temperature=1.0)])
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_samples_stay_inside_the_kept_set():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 2).log()
    by_p, by_k = Request(temperature=1.0, top_p=0.7, seed=0), Request(temperature=2.0, top_k=3, seed=0)
    sampler = Sampler()
    seen_p, seen_k = set(), set()
    for _ in range(100):
        out = sample(sampler, logits, [by_p, by_k])
        seen_p.add(out.token_ids[0])
        seen_k.add(out.token_ids[1])
    assert seen_p == {0, 1}
    assert seen_k == {0, 1, 2}


def test_top_k_one_equals_greedy():
    logits = random_logits(6, seed=4)
    requests = [Request(temperature=1.3, top_k=1, seed=i) for i in range(6)]
    assert sample(Sampler(), logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_logprobs_come_from_the_unmodified_distribution():
    logits = random_logits(3, seed=5)
    requests = [Request(logprobs=3), Request(), Request(temperature=1.7, top_k=2, seed=1, logprobs=0)]
    out = sample(Sampler(), logits, requests)
    reference = torch.log_softmax(logits, dim=-1)
    a, b, c = out.logprobs
    assert b is None
    assert a.token_id == out.token_ids[0]
    assert a.logprob == pytest.approx(reference[0].max().item())
    values, ids = reference[0].topk(3)
    assert [t for t, _ in a.top] == ids.tolist()
    assert [v for _, v in a.top] == pytest.approx(values.tolist())
    assert c.top == []
    assert c.logprob == pytest.approx(reference[2, out.token_ids[2]].item())
    assert math.exp(a.logprob) <= 1.0


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match=r"expected logits \[2, vocab\]"):
        sample(Sampler(), random_logits(3), [Request(), Request()])
    with pytest.raises(ValueError, match="row 0 samples .* no generator"):
        Sampler()(random_logits(1), [SamplingParams(temperature=1.0)], [None])
