"""The engine on the real model: token-for-token parity with Hugging Face, batching invariance.

Slow-ish (real 135M model on CPU) but the core promise of the engine: continuous batching,
chunked prefill, paging and preemption never change what a greedy request outputs.
"""
from __future__ import annotations

import pytest
import torch

from engine_utils import greedy, make_core, run_all

pytestmark = pytest.mark.slow

USER_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a five-year-old.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):",
    "What does HTTP status code 404 mean?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "How many legs does a spider have?",
    "Write a Python function that reverses a string.",
    "What is 17 multiplied by 23?",
    "Name the planets of the solar system in order.",
    "Describe a cat to someone who has never seen one.",
    "What are the benefits of regular exercise?",
    "Écris une phrase en français sur la pluie.",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a short joke about computers.",
]


def _chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered)


def test_greedy_matches_hugging_face_token_for_token(bundled_model, hf_bundled_model):
    tok = bundled_model.tokenizer
    prompts = {f"p{i}": _chat_ids(tok, t) for i, t in enumerate(USER_PROMPTS)}
    # Both stop at end-of-sequence (ours reports the eos token id too) or after 64 tokens.
    core = make_core(bundled_model)
    ours = run_all(core, prompts, greedy(64))
    mismatches = []
    for rid, ids in prompts.items():
        with torch.inference_mode():
            ref = hf_bundled_model.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64, do_sample=False, pad_token_id=2)
        ref_new = ref[0, len(ids):].tolist()
        if ours[rid]["tokens"] != ref_new:
            mismatches.append((rid, ours[rid]["tokens"], ref_new))
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} prompts differ; first: {mismatches[0]}"
    assert sum(len(r["tokens"]) for r in ours.values()) >= 20 * 16, "answers too short to compare"


def _mixed_requests(tok) -> tuple[dict[str, list[int]], dict]:
    from kvmesh.model.perplexity import reference_text

    text_ids = tok.encode(reference_text()[:60_000])
    prompts, params = {}, {}
    for i in range(32):
        n = [7, 40, 130, 300, 520][i % 5] + i          # mixed lengths, some span several chunks
        start = (i * 997) % (len(text_ids) - n)
        prompts[f"r{i}"] = text_ids[start:start + n]
        params[f"r{i}"] = greedy(8 + (i * 7) % 25, ignore_eos=True)
    return prompts, params


def test_32_concurrent_requests_equal_each_alone(bundled_model):
    tok = bundled_model.tokenizer
    prompts, params = _mixed_requests(tok)
    together = run_all(make_core(bundled_model, max_num_batched_tokens=256), prompts, params)
    for rid in prompts:
        alone = run_all(make_core(bundled_model, max_num_batched_tokens=256), {rid: prompts[rid]}, params)
        assert together[rid]["tokens"] == alone[rid]["tokens"], rid
        assert len(together[rid]["tokens"]) == params[rid].max_tokens


def test_preemption_by_recompute_keeps_outputs(bundled_model):
    """A pool too small for all requests at once forces preemption; outputs must not change."""
    tok = bundled_model.tokenizer
    prompts, params = _mixed_requests(tok)
    prompts = {k: v for k, v in list(prompts.items())[:10]}
    params = {k: params[k] for k in prompts}
    roomy = run_all(make_core(bundled_model, num_blocks=512), prompts, params)
    tight_core = make_core(bundled_model, num_blocks=60, enable_prefix_caching=False)
    tight = run_all(tight_core, prompts, params)
    assert tight_core.scheduler.num_preemptions > 0, "pool was not small enough to preempt"
    for rid in prompts:
        assert tight[rid]["tokens"] == roomy[rid]["tokens"], rid


@pytest.fixture(scope="module")
def bundled_gguf_model():
    """The bundled model on its GGUF blocks (the CPU default, `weights="gguf"`)."""
    from kvmesh.model.loader import load_model

    return load_model("bundled", weights="gguf", progress=False)


@pytest.mark.parametrize("weights", ["gguf", "fp32"])
def test_a_prompt_prefilled_alone_in_big_chunks_gives_the_same_answer(
        weights, bundled_model, bundled_gguf_model):
    """--solo-prefill-tokens: with nothing decoding, a prompt's chunks grow from 256 tokens to
    2,048. The default GGUF weights on the AMX tile unit (matmuls and attention) give the same
    logprobs bit for bit; without it (MKL's fp32 on dequantized tiles, SDPA) and with fp32
    weights (MKL, whose sgemm rounds a 76-row chunk's products differently) the same tokens,
    logprobs within fp32 rounding."""
    from kvmesh.model import amx_attention
    from kvmesh.model.gguf_native import gguf_ops
    from kvmesh.model.perplexity import reference_text

    model = bundled_gguf_model if weights == "gguf" else bundled_model
    ids = model.tokenizer.encode(reference_text()[:20_000])[:1100]
    params = greedy(6, ignore_eos=True, logprobs=3)
    runs = {}
    for solo in (0, 2048):
        core = make_core(model, max_num_batched_tokens=256, solo_prefill_tokens=solo)
        steps, step = [], core.step
        core.step = lambda: steps.append(1) or step()
        runs[solo] = run_all(core, {"r": ids}, params)["r"], len(steps)
    (chunked, chunked_steps), (solo, solo_steps) = runs[0], runs[2048]
    assert (chunked_steps, solo_steps) == (5 + 5, 1 + 5)  # 1,100 tokens: 5 chunks of <= 256, or 1
    assert solo["tokens"] == chunked["tokens"] and len(solo["tokens"]) == 6
    ops = gguf_ops()
    if weights == "gguf" and ops is not None and ops.gguf_amx() and amx_attention.prepare():
        assert solo["logprobs"] == chunked["logprobs"]
    else:
        got = [(t.token_id, *(lp for _, lp in t.top)) for t in solo["logprobs"]]
        want = [(t.token_id, *(lp for _, lp in t.top)) for t in chunked["logprobs"]]
        assert [g[0] for g in got] == [w[0] for w in want]
        assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1:], w[1:])) < 1e-4
