"""The quality benchmark's metrics on hand-made values: first divergence and exact match from the
teacher-forced argmax, pooled and per-prompt aggregation, spreads, TTFT speedups, the plan's
prompt selection and the split setting."""
import pytest
import torch

from kvmesh.kv.quality import Comparison, compare, first_divergence
from kvmesh.loadtest import quality_bench as qb
from kvmesh.loadtest.quality_workloads import QualityPrompt


def test_first_divergence():
    assert first_divergence([5, 6, 7], [5, 6, 7]) == 3  # none: the answer's length
    assert first_divergence([5, 6, 7], [4, 6, 7]) == 0
    assert first_divergence([5, 6, 7, 8], [5, 6, 9, 8]) == 2  # later agreement does not count
    assert first_divergence([5, 6, 7], [5, 6]) == 2
    assert first_divergence([], [1]) == 0


def _prompt(i: int, workload: str, split: str = "test") -> QualityPrompt:
    return QualityPrompt(f"{workload}-{split}-{i:03d}", workload, split, (((1, 2), False),), (), "src", "q?")


def test_score_takes_the_greedy_path_from_the_teacher_forced_argmax():
    answer = [2, 0, 1]
    exact = torch.full((3, 4), -5.0)
    exact[torch.arange(3), torch.tensor(answer)] = 5.0
    lossy = exact.clone()
    lossy[1, 3] = 9.0  # position 1 now prefers token 3
    s = qb.score(_prompt(0, "rag"), "codec=int4", None, answer, compare(exact, lossy, torch.tensor(answer)),
                 lossy.argmax(-1).tolist())
    assert (s.divergence, s.exact_match, s.top1) == (1, False, pytest.approx(2 / 3))
    same = qb.score(_prompt(0, "rag"), "codec=fp32", None, answer, compare(exact, exact, torch.tensor(answer)),
                    exact.argmax(-1).tolist())
    assert (same.divergence, same.exact_match, same.kl, same.ppl_delta) == (3, True, 0.0, 0.0)


def _s(i, workload, tokens, divergence, top1, kl, nll_lossy):
    p = _prompt(i, workload)
    return qb.score(p, "blend=0.15", 0.15, list(range(tokens)), Comparison(tokens, kl, top1, 1.0, nll_lossy),
                    list(range(divergence)) + [-1] * (tokens - divergence))


def test_quality_rows_pool_tokens_and_average_prompts():
    scores = [_s(0, "rag", 10, 10, 1.0, 0.0, 1.0),  # no divergence: counts as 10
              _s(1, "chat", 30, 4, 0.8, 0.2, 1.1)]
    rows = qb.quality_rows(scores)

    def get(metric, workload="all", stat=None):
        (r,) = [r for r in rows if r["metric"] == metric and r["workload"] == workload and r.get("stat") == stat]
        assert (r["split"], r["path"], r["ratio"]) == ("test", "blend=0.15", 0.15)
        return r["value"]

    assert get("exact_match") == 0.5
    assert get("first_divergence") == 7.0
    assert get("top1") == pytest.approx((10 * 1.0 + 30 * 0.8) / 40)  # pooled over answer tokens
    assert get("kl") == pytest.approx(30 * 0.2 / 40)
    assert get("ppl_delta_pct") == pytest.approx(100 * (0 + (2.718281828 ** 0.1 - 1)) / 2, rel=1e-6)
    assert (get("top1", stat="min"), get("top1", stat="median"), get("top1", stat="max")) == (0.8, 0.9, 1.0)
    assert get("first_divergence", stat="max") == 10.0
    assert get("exact_match", "rag") == 1.0 and get("exact_match", "chat") == 0.0
    assert not [r for r in rows if r["metric"] == "exact_match" and "stat" in r]  # 0/1 per prompt: no spread
    assert qb.answer_rows(scores) == [
        {"split": "test", "workload": w, "path": "exact", "metric": "answer_tokens", "value": v, "unit": "tokens"}
        for w, v in (("rag", 10), ("all", 20), ("chat", 30))]


def test_ttft_rows():
    rows = qb.ttft_rows([4.0, 2.0], {0.15: [1.0, 1.0]})
    value = {(r["path"], r["metric"], r.get("stat")): r["value"] for r in rows}
    assert value[("full", "ttft_s", None)] == 3.0 and value[("full", "ttft_speedup", None)] == 1.0
    assert value[("blend=0.15", "ttft_speedup", None)] == 3.0  # mean full / mean blended
    assert (value[("blend=0.15", "ttft_speedup", "min")], value[("blend=0.15", "ttft_speedup", "max")]) == (2.0, 4.0)
    assert all(r["ratio"] == (1.0 if r["path"] == "full" else 0.15) for r in rows)
    table = qb.table(rows + qb.quality_rows([_s(0, "rag", 10, 10, 1.0, 0.0, 1.0)]))
    assert "blend=0.15" in table and "ttft_speedup" in table


def test_select_spreads_the_plan_over_each_group():
    prompts = [_prompt(i, w, s) for s in ("dev", "test") for w in ("rag", "chat", "longdoc") for i in range(10)]
    chosen = qb.select(prompts, 4)
    assert [p.id for p in chosen if p.split == "test" and p.workload == "rag"] == [
        "rag-test-000", "rag-test-002", "rag-test-005", "rag-test-007"]
    assert len(chosen) == 24 and qb.select(prompts, 0) == prompts


def test_split_setting(monkeypatch):
    monkeypatch.delenv(qb.SPLIT_ENV, raising=False)
    assert qb.splits_from_env() == ("test",)
    monkeypatch.setenv(qb.SPLIT_ENV, "both")
    assert qb.splits_from_env() == ("dev", "test")
    monkeypatch.setenv(qb.SPLIT_ENV, "train")
    with pytest.raises(SystemExit, match="dev, test or both"):
        qb.splits_from_env()


def test_ratio_setting(monkeypatch):
    monkeypatch.delenv(qb.RATIOS_ENV, raising=False)
    assert qb.ratios_from_env(qb.FULL.ratios) == qb.FULL.ratios
    monkeypatch.setenv(qb.RATIOS_ENV, "0.15, 0.25")
    assert qb.ratios_from_env(qb.FULL.ratios) == (0.15, 0.25)
    for bad in ("", "a", "1.5"):
        monkeypatch.setenv(qb.RATIOS_ENV, bad)
        with pytest.raises(SystemExit, match="recompute ratios in"):
            qb.ratios_from_env(qb.FULL.ratios)
