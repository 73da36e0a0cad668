"""The bundled SmolLM2-135M GGUF against transformers' own GGUF loading (slow: loads both models)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvmesh.model import gguf_loader
from kvmesh.model.hf_loader import sha256_file
from kvmesh.model.llama import fuse_projections
from kvmesh.model.loader import bundled_gguf_path, load_model
from kvmesh.model.perplexity import perplexity, reference_text
from kvmesh.model.tokenizer import IncrementalDetokenizer

from .paged import greedy_paged
from .test_perplexity import hf_guide_perplexity

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n\n\tx = {'a': [1, 2]}\n",
    "naïve café — “quotes” «guillemets» 日本語のテキスト 한국어 Ελληνικά русский",
    "emoji 👍🏽 👨‍👩‍👧 🇫🇷 ✨ done",
    "digits 1234567 3.14159 1,000,000 007 2024-06-01",
    "   leading and trailing   \n\n\n  \t\t \r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> a<|im_end|>b <file_sep><filename>x.py",
    "'s 're I'm DON'T y'all",
    "",
    " ",
    "x" * 300,
]


def test_config_and_weights_equal_transformers(real_model, hf_gguf_model):
    c = real_model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        30, 576, 9, 3, 64, 1536)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings, c.tie_word_embeddings) == (49152, 1e5, 8192, True)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,)) and c.rms_norm_eps == pytest.approx(1e-5)
    assert real_model.weights_digest == sha256_file(bundled_gguf_path())
    ours = real_model.model.state_dict()
    theirs = fuse_projections(hf_gguf_model.state_dict(), c.num_layers)  # our q|k|v and gate|up layout
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_tokenizer_matches_transformers(real_model, hf_gguf_tokenizer):
    tok, hf = real_model.tokenizer, hf_gguf_tokenizer
    texts = TEXTS + [reference_text()[:3000]]
    rng = random.Random(0)
    for _ in range(20):  # random printable unicode, no numerals (see the next test)
        texts.append("".join(rng.choice("ab cd\n\t.,;'é中👍ÿ€\u00a0") for _ in range(60)))
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.encode("hi", add_special_tokens=True) == hf.encode("hi")  # no BOS for this model
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_numerals_split_like_llama_cpp(real_model, hf_gguf_tokenizer):
    """SmolLM's pre-tokenizer (llama.cpp 'smollm', and the original tokenizer.json) isolates every
    \\p{N} character before the GPT-2 regex. transformers' GGUF converter omits that split, so the
    two differ only where a space precedes a non-ASCII numeral (ASCII digits never merge)."""
    tok = real_model.tokenizer
    assert [tok.id_to_piece(i) for i in tok.encode(" ²³ ½")] == ["Ġ", "Â²", "Â³", "Ġ", "Â½"]
    assert hf_gguf_tokenizer.convert_ids_to_tokens(hf_gguf_tokenizer.encode(" ½")) == ["ĠÂ", "½"]
    assert tok.encode(" 12") == hf_gguf_tokenizer.encode(" 12") == [216, 33, 34]


def test_chat_template_matches_transformers(real_model, hf_gguf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "Bye"}],
    ]
    for msgs in conversations:
        for gen in (True, False):
            want = hf_gguf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert real_model.tokenizer.apply_chat_template(msgs, add_generation_prompt=gen) == want


def _chat_ids(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_greedy_generation_matches_transformers(real_model, hf_gguf_model):
    tok = real_model.tokenizer
    prompts = [_chat_ids(tok, "Write a haiku about the sea."), _chat_ids(tok, "List three prime numbers.")]
    ours = greedy_paged(real_model.model, prompts, max_new=24, prefill_chunk=16)
    for prompt, got in zip(prompts, ours):
        x = torch.tensor([prompt])
        with torch.no_grad():  # explicit mask: the prompt contains <|im_end|>, which is also the pad id
            out = hf_gguf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24,
                                         do_sample=False, eos_token_id=None, pad_token_id=2)
        assert got == out[0, len(prompt):].tolist()
        assert tok.decode(got).strip()


def test_incremental_detokenizer_on_real_vocab(real_model):
    tok = real_model.tokenizer
    prompt = _chat_ids(tok, "Say hello in Japanese and add an emoji.")
    gen = greedy_paged(real_model.model, [prompt], max_new=24, prefill_chunk=32)[0]
    streams = [gen, tok.encode("日本語 👨‍👩‍👧 café €5 <|im_end|> done")]
    rng = random.Random(1)
    streams += [[rng.randrange(tok.vocab_size) for _ in range(30)] for _ in range(50)]  # split UTF-8 galore
    for ids in streams:
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            deltas = [detok.step([t]) for t in ids] + [detok.flush()]
            assert "".join(deltas) == tok.decode(prompt + ids, skip)[len(tok.decode(prompt, skip)):]
            assert all(not d.endswith("\ufffd") for d in deltas[:-1]) or "\ufffd" in tok.decode(ids, skip)


def test_perplexity_matches_transformers(real_model, hf_gguf_model):
    ids = torch.tensor(real_model.tokenizer.encode(reference_text())[:768])
    ours = perplexity(real_model.model, ids, window=512, stride=256)
    theirs = hf_guide_perplexity(hf_gguf_model, ids, window=512, stride=256)
    assert ours == pytest.approx(theirs, rel=1e-3)
    assert 5 < ours < 40


def test_restart_loads_from_cache(real_model, monkeypatch):
    def no_convert(*_a, **_k):
        raise AssertionError("GGUF converted again on restart")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_convert)
    t0 = time.perf_counter()
    again = load_model("bundled")  # real_model converted into the default cache
    elapsed = time.perf_counter() - t0
    assert again.weights_digest == real_model.weights_digest
    assert again.tokenizer.encode("cache hit") == real_model.tokenizer.encode("cache hit")
    print(f"restart load: {elapsed:.2f}s")
