"""Each family's tokenizer (built here: Llama 3's byte-level BPE and split, Qwen2's, and the
SentencePiece BPE of Llama 2 / Mistral) through both formats: the HF folder's tokenizer.json and a
GGUF file's metadata, where kvmesh rebuilds the tokenizer from llama.cpp's pre-tokenizer name or
from the pieces' scores. Ids must equal the original tokenizer's; an unknown pre-tokenizer is
refused instead of silently splitting text another way."""
from __future__ import annotations

import json

import pytest

from kvmesh.model.tokenizer import Tokenizer
from model_families import build_tokenizer, tiny_models, tokenizer_metadata

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving 1,234 requests in 0.25 seconds; it's fine, we'll see.",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\r\n\n\tindented\ttabs",
    "Grüße aus Köln! Ça va très bien. 東京で会いましょう 👋🏽",
    "Numbers 12345678 and 3.14159, symbols #$%&*+-/<=>@[]^_{|}~",
    "def main():\n    return 42\n",
    "DON'T SHOUT, YOU'LL SEE. They'RE here.",
    "e\u0301 (e + combining accent) and \u00e9",
]
FAMILIES = ("llama", "qwen2", "mistral")


def _hf_folder_tokenizer(tmp_path, family: str) -> Tokenizer:
    build_tokenizer(family).save(str(tmp_path / "tokenizer.json"))
    bos, eos = tiny_models.SPECIAL_ROLES[family]
    cfg = {"bos_token": bos, "eos_token": eos, "chat_template": tiny_models.TEMPLATES[family]}
    if family == "mistral":
        cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_hf_folder(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_and_hf_folder_tokenize_like_the_original(tmp_path, family):
    original = build_tokenizer(family)
    from_gguf = Tokenizer.from_gguf_metadata(tokenizer_metadata(family))
    from_folder = _hf_folder_tokenizer(tmp_path, family)
    for text in TEXTS:
        want = original.encode(text, add_special_tokens=False).ids
        assert from_gguf.encode(text) == want, text
        assert from_folder.encode(text) == want, text
        assert from_gguf.decode(want) == original.decode(want) == from_folder.decode(want)
    # BOS as each family's model expects it, special tokens matched whole
    bos, eos = tiny_models.SPECIAL_ROLES[family]
    for tok in (from_gguf, from_folder):
        ids = tok.encode(f"hi{eos}", add_special_tokens=True)
        assert ids[-1] == original.token_to_id(eos)
        assert (bos is not None) == (ids[0] == original.token_to_id(bos or eos))
        assert tok.eos_token_ids == (original.token_to_id(eos),)
    assert from_gguf.fingerprint() == from_folder.fingerprint()  # same model: the gateway accepts either


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_and_chat_template(tmp_path, family):
    tok = Tokenizer.from_gguf_metadata(tokenizer_metadata(family))
    for text in TEXTS:
        if family == "qwen2":  # Qwen2 NFC-normalizes: decomposed accents come back composed
            import unicodedata
            text = unicodedata.normalize("NFC", text)
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert "Hello there" in prompt
    again = tok.decode(tok.encode(prompt), skip_special_tokens=False)
    assert again.replace(" ", "") == prompt.replace(" ", "")


def test_sentencepiece_matches_transformers_gguf_tokenizer(tmp_path):
    """An independent rebuild of the same GGUF metadata (transformers' own GGUF tokenizer
    converter) gives the same ids."""
    import gguf
    from transformers import AutoTokenizer

    from model_families import _add_tokenizer

    meta = tokenizer_metadata("mistral")
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    _add_tokenizer(w, meta)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_gguf_metadata(meta)
    for text in TEXTS[:2] + TEXTS[4:]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("pre", ["default", "tekken", "deepseek-llm", None])
def test_unknown_gguf_pre_tokenizer_is_refused(pre):
    meta = tokenizer_metadata("llama", pre="x")
    if pre is None:
        del meta["tokenizer.ggml.pre"]
    else:
        meta["tokenizer.ggml.pre"] = pre
    with pytest.raises(ValueError, match=f"pre-tokenizer {pre!r} is not supported.*llama-bpe.*qwen2"):
        Tokenizer.from_gguf_metadata(meta)


def test_other_gguf_tokenizer_models_are_refused():
    meta = tokenizer_metadata("llama")
    meta["tokenizer.ggml.model"] = "t5"
    with pytest.raises(ValueError, match="tokenizer model 't5' unsupported.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf_metadata(meta)


def test_chat_template_override_and_fingerprint(tmp_path):
    tok = _hf_folder_tokenizer(tmp_path, "qwen2")
    custom = tok.with_chat_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    assert custom.fingerprint() == tok.fingerprint()  # the template does not change token ids
    assert Tokenizer.from_gguf_metadata(tokenizer_metadata("llama")).fingerprint() != tok.fingerprint()


def test_read_chat_template_takes_a_file_or_the_template(tmp_path):
    from kvmesh.model.tokenizer import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}!")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}!"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
