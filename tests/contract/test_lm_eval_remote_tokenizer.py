"""lm-eval's own `local-completions` client with `tokenizer_backend=remote` against the gateway:
no local tokenizer, only the gateway's /tokenizer_info, /tokenize and /detokenize. A two-document
loglikelihood task is built in the test; the fake router gives prompt token j the logprob
-0.25 * j, so each loglikelihood lm-eval reports says exactly which tokens it scored: those of the
continuation, as the gateway's tokenizer splits it.

lm-eval comes with the `test` extra (`lm-eval[api]`: its API models also need tenacity and
aiohttp); the test skips where it is not installed. Checked with lm-eval 0.4.13."""
from __future__ import annotations

import json
import math

import pytest

from gateway_utils import MODEL

DOCS = [{"context": "Question: 2 + 2 =", "continuation": " 4"},
        {"context": "The capital of France is", "continuation": " Paris, of course."}]

TASK = """task: kvmesh_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
"""


def test_lm_eval_local_completions_with_the_remote_tokenizer(gateway, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install \"lm-eval[api]\")")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kvmesh_tiny.yaml").write_text(TASK.format(data=data))

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": gateway.base_url + "/completions",
                    "tokenizer_backend": "remote", "num_concurrent": 1, "max_retries": 1},
        tasks=["kvmesh_tiny"], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, limit=None)

    tok = gateway.tokenizer
    samples = sorted(results["samples"]["kvmesh_tiny"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    for doc, sample in zip(DOCS, samples):
        context, continuation = tok.encode(doc["context"]), tok.encode(doc["continuation"])
        ctxlen, n = len(context), len(context) + len(continuation)
        want = -0.25 * sum(range(ctxlen, n))  # the prompt logprobs of the continuation's tokens
        [(loglikelihood, _greedy)] = sample["filtered_resps"]
        assert math.isclose(loglikelihood, want, abs_tol=1e-6), (doc, sample["filtered_resps"], want)
    # every scored request went upstream as the gateway's own token ids: context + continuation
    sent = [list(c.request.request.token_ids.ids) for c in gateway.state.calls]
    for doc in DOCS:
        assert tok.encode(doc["context"]) + tok.encode(doc["continuation"]) in sent
