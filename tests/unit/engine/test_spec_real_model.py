"""Speculative decoding on the bundled SmolLM2 model (slow): greedy chat outputs with prompt-lookup
drafts from a fake draft service are token for token those of plain decoding."""
import pytest

from engine_utils import FakeDraftService, greedy, make_core, run_all

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog. The quick brown fox.",
    "Write a Python function that returns the sum of a list of numbers.",
    "List the days of the week, separated by commas.",
    "Explain what a hash table is in two sentences.",
    "Count from one to twenty in words.",
    "Translate 'good morning, how are you?' into French.",
    "Give three tips for writing clear emails.",
    "What is 12 times 12? Show the multiplication.",
    "Spell the word 'banana' letter by letter, then say it again.",
]


def prompt_lookup(rid, history, k):
    """Drafts like the n-gram drafter: the tokens that followed the latest earlier occurrence of
    the history's last 3 (else 2, else 1) tokens."""
    for n in (3, 2, 1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return history[start + n:start + n + k]
    return []


def test_greedy_chat_outputs_identical_with_prompt_lookup_drafts(bundled_model):
    tok = bundled_model.tokenizer
    prompts = {f"q{i}": tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for i, q in enumerate(QUESTIONS)}
    params = greedy(48)
    kw = dict(num_blocks=256, block_size=16, max_num_batched_tokens=512, max_num_seqs=16)
    plain = run_all(make_core(bundled_model, **kw), prompts, params)
    fake = FakeDraftService(prompt_lookup)
    try:
        # every sequence drafts at every step (not the deployment's gated, row-budgeted drafting),
        # so the outputs are compared with drafts verified throughout
        core = make_core(bundled_model, draft_address=fake.address, draft_timeout_s=10.0,
                         speculation="ngram", spec_step_rows=256, **kw)
        spec = run_all(core, prompts, params)
    finally:
        fake.stop()
    for rid in prompts:
        assert spec[rid]["tokens"] == plain[rid]["tokens"], (rid, spec[rid]["text"], plain[rid]["text"])
        assert spec[rid]["text"] == plain[rid]["text"]
    totals = core.spec_totals
    assert totals.draft_tokens > 100 and totals.accepted_tokens > 20
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
