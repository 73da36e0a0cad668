"""A GGUF file's tokenizer as a Rust ``tokenizers.Tokenizer``: byte-level BPE (``gpt2``: Llama 3,
Qwen2, SmolLM) with the pre-tokenizer llama.cpp selects by ``tokenizer.ggml.pre``, and
SentencePiece BPE (``llama``: Llama 2, Mistral) rebuilt from the pieces and their scores.

NOTE (pre-tokenizers). A GGUF file names its BPE pre-tokenizer (``tokenizer.ggml.pre``) but does
not store it: llama.cpp keeps one regex per name. An unknown name would otherwise fall back to
some default split and give wrong token ids without any error, so only the names below load and
every other one is refused, naming the known ones. Each entry is the split the model's own
``tokenizer.json`` applies (Llama 3 and Qwen2: one regex, ``Isolated``, then byte-level without
GPT-2's regex; Qwen2 also NFC-normalizes; SmolLM: every digit alone, then GPT-2's regex).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible space


def _gpt2(backend: tokenizers.Tokenizer) -> None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm(backend: tokenizers.Tokenizer) -> None:
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _split_then_bytes(regex: str, nfc: bool = False) -> Callable[[tokenizers.Tokenizer], None]:
    def apply(backend: tokenizers.Tokenizer) -> None:
        if nfc:
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return apply


BPE_PRE_TOKENIZERS: dict[str, Callable[[tokenizers.Tokenizer], None]] = {
    "gpt-2": _gpt2,
    "smollm": _smollm,
    "llama3": _split_then_bytes(LLAMA3_SPLIT),
    "llama-v3": _split_then_bytes(LLAMA3_SPLIT),
    "llama-bpe": _split_then_bytes(LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(QWEN2_SPLIT, nfc=True),
}
"""``tokenizer.ggml.pre`` values that load, and how each splits text before BPE."""


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def backend_from_gguf(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The Rust tokenizer of a GGUF file's ``tokenizer.*`` metadata (special tokens included).
    ValueError naming what to use instead for a tokenizer model or pre-tokenizer that does not load."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} unsupported; supported: 'gpt2' (byte-level BPE: Llama 3, "
                         "Qwen2, SmolLM) and 'llama' (SentencePiece BPE: Llama 2, Mistral). Serve the model's HF "
                         "folder (tokenizer.json) instead")
    # Control tokens are special; so is SentencePiece's <unk>, as in the models' tokenizer.json.
    special = (TOKEN_CONTROL, TOKEN_UNKNOWN) if kind == "llama" else (TOKEN_CONTROL,)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED])
    return backend


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in BPE_PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (token ids would be wrong); supported: "
                         f"{', '.join(sorted(BPE_PRE_TOKENIZERS))}. Serve the model's HF folder (tokenizer.json) "
                         "instead")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bmap = byte_alphabet()
    alphabet = set(bmap.values())
    # A token spelled outside the byte alphabet (rare, llama.cpp writes some control tokens
    # that way) is re-spelled byte-wise so the BPE vocabulary stays consistent.
    vocab = {t if set(t) <= alphabet else "".join(bmap[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    BPE_PRE_TOKENIZERS[pre](backend)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece BPE merges the adjacent pair whose merged piece scores highest; as ranked
    merges that is every split of a normal piece into two pieces of the vocabulary, ranked by the
    merged piece's score. Unknown characters fall back to the <0xNN> byte pieces."""
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise ValueError("GGUF SentencePiece tokenizer without one tokenizer.ggml.scores entry per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (piece, ty) in enumerate(zip(tokens, types)):
        if ty != TOKEN_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], (left, right)))
    merges = [m for *_, m in sorted(ranked)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == TOKEN_UNKNOWN), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                              unk_token=None if unk_id is None else tokens[int(unk_id)]))
    replace = normalizers.Replace(" ", SPM_SPACE)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend
