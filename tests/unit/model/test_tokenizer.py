"""Tokenizer construction from GGUF metadata, chat templates, and incremental detokenization."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers

from kvmesh.model.tokenizer import IncrementalDetokenizer, Tokenizer, _byte_alphabet

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "{{ bos_token }}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tiny_tokenizer_meta(pre: str = "smollm") -> dict:
    """GGUF ``tokenizer.*`` metadata of a 264-token byte-level BPE (every byte is a token)."""
    specials = ["<|endoftext|>", "<s>", "</s>"]
    bytes_ = [_byte_alphabet()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + bytes_ + merged
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": TEMPLATE,
    }
    return meta


def tiny_gguf_tokenizer(pre: str = "smollm") -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_tokenizer_meta(pre))


def test_gguf_metadata_tokenizer_roundtrip():
    tok = tiny_gguf_tokenizer()
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (264, 1, (2,))
    ids = tok.encode("the cat in 2024</s>")
    pieces = [tok.id_to_piece(i) for i in ids]
    assert pieces[:1] == ["the"] or pieces[:2] == ["t", "he"]
    assert "Ġa" not in pieces and pieces[-1] == "</s>"  # special token matched whole
    assert ["2", "0", "2", "4"] == [p for p in pieces if p.isdigit()]  # digits split one by one
    assert tok.decode(ids) == "the cat in 2024"
    assert tok.decode(ids, skip_special_tokens=False) == "the cat in 2024</s>"
    assert tok.encode("héllo 👋") and tok.decode(tok.encode("héllo 👋")) == "héllo 👋"


def test_save_and_reload_as_hf_folder(tmp_path):
    tok = tiny_gguf_tokenizer()
    tok.save_hf(tmp_path)
    again = Tokenizer.from_hf_folder(tmp_path)
    text = "Ġodd the  \n\t 123 ünï </s><s>"
    assert again.encode(text) == tok.encode(text)
    assert (again.bos_token_id, again.eos_token_ids, again.chat_template) == (1, (2,), TEMPLATE)


def test_chat_template():
    tok = tiny_gguf_tokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(msgs) == "<s><|user|>\nhi</s>\n<s><|assistant|>\nyo</s>\n<|assistant|>\n"
    assert tok.apply_chat_template(msgs[:1], add_generation_prompt=False) == "<s><|user|>\nhi</s>\n"
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="template"):  # the sandbox forbids attribute mutation
        Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2],
                  chat_template="{{ messages.append(1) }}").apply_chat_template(msgs)


def _stream(tok: Tokenizer, prompt: list[int], gen: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [detok.step([t]) for t in gen] + [detok.flush()]


def test_detokenizer_holds_back_split_characters():
    tok = tiny_gguf_tokenizer()
    ids = tok.encode("a 👋 é")
    assert len(ids) > 5  # the emoji is 4 single-byte tokens here
    deltas = _stream(tok, [], ids)
    assert "".join(deltas) == "a 👋 é"
    assert all("\ufffd" not in d for d in deltas)
    assert "👋" in deltas  # emitted exactly once, whole, when its last byte arrives


def test_detokenizer_random_ids_concatenate_to_full_decode():
    tok = tiny_gguf_tokenizer()
    rng = random.Random(0)
    for _ in range(200):
        prompt = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(0, 4))]
        gen = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            # decoding starts clean when the prompt decodes clean
            if tok.decode(prompt, skip).endswith("\ufffd"):
                continue
            want = tok.decode(prompt + gen, skip)[len(tok.decode(prompt, skip)):]
            assert "".join(_stream(tok, prompt, gen, skip)) == want


def test_detokenizer_character_straddling_prompt_boundary():
    tok = tiny_gguf_tokenizer()
    ids = tok.encode("x€")  # 'x' + '€' as 3 byte tokens; the prompt ends after the first of them
    assert len(ids) == 4
    assert _stream(tok, ids[:2], ids[2:]) == ["", "€", ""]


def sentencepiece_like() -> Tokenizer:
    """A non-byte-level tokenizer (Metaspace + byte fallback) to exercise the text-diff path."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "▁hello": 4, "▁world": 5, "o": 6}
    vocab.update({f"<0x{b:02X}>": 7 + b for b in range(256)})
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=None, add_bos_token=True)


def test_text_diff_detokenizer():
    tok = sentencepiece_like()
    assert not tok.is_byte_level
    assert tok.encode("hello", add_special_tokens=True)[0] == 1
    euro = [7 + b for b in "€".encode()]
    gen = [5, 3, *euro, 4, 2, 6]
    prompt = [1, 4]
    deltas = _stream(tok, prompt, gen)
    assert "".join(deltas) == tok.decode(prompt + gen)[len(tok.decode(prompt)):] == " world € helloo"
    assert deltas[2:5] == ["", "", "€"]  # byte-fallback pieces held until the character completes
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
