"""Tokenizer: text <-> token ids, chat templates, and incremental detokenization for streaming.

One class wraps a Rust ``tokenizers.Tokenizer`` built either from GGUF metadata (byte-level or
SentencePiece BPE, kvmesh.model.gguf_tokenizer) or from an HF folder (``tokenizer.json`` + ``tokenizer_config.json``), so the gateway and the engine
never care where the model came from.
"""

from __future__ import annotations

import codecs
import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders

from kvmesh.model.gguf_tokenizer import backend_from_gguf, byte_alphabet

_byte_alphabet = byte_alphabet  # the name tests and older callers import
_PROBE = ("The quick brown fox, 1,234 times in 2025: don't stop! I'LL see.\n\tcode() -> {x: [1, 2.5]}  "
          "Grüße aus Köln, e\u0301t\u00e9, 東京 👋🏽 \u00a0end  ")
"""Text whose ids `Tokenizer.fingerprint` covers: contractions, digits, whitespace runs, accents
(composed and not), CJK and emoji, where pre-tokenizers and normalizers differ."""


@lru_cache(maxsize=1)
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    Special (control) tokens written literally in the text are always matched whole, like HF
    tokenizers do by default; ``add_special_tokens`` only controls the BOS the model expects.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = backend
        self._bos_id = bos_token_id
        self._eos_ids = tuple(int(t) for t in eos_token_ids)
        self._add_bos = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        # Byte-level decoders let the detokenizer work on exact bytes; anything else takes the
        # text-diffing path (see IncrementalDetokenizer).
        self.is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._template: jinja2.Template | None = None

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF file's ``tokenizer.*`` metadata (values as plain Python objects):
        byte-level BPE with a pre-tokenizer llama.cpp knows, or SentencePiece BPE; anything else
        is refused (kvmesh.model.gguf_tokenizer)."""
        backend = backend_from_gguf(meta)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        add_bos_default = meta.get("tokenizer.ggml.model") == "llama"  # SentencePiece models start with <s>
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path, eos_token_ids: Sequence[int] | None = None) -> Tokenizer:
        """Build from an HF folder's ``tokenizer.json`` and ``tokenizer_config.json``.

        ``eos_token_ids`` (usually from config.json / generation_config.json) overrides the EOS
        named in tokenizer_config.json.
        """
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} missing: only fast (tokenizer.json) tokenizers load")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg_file = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, dict):  # AddedToken serialized as a dict
                value = value.get("content")
            return None if value is None else backend.token_to_id(value)

        template = cfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos = token_id("eos_token")
        if eos_token_ids is None:
            eos_token_ids = [] if eos is None else [eos]
        bos = token_id("bos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None and bos is not None:
            # No flag (Llama 3's folders): the BOS is added by tokenizer.json's post-processor when
            # it puts one in front of an encode that lacks it, as HF's encode would.
            plain = backend.encode("a", add_special_tokens=False).ids
            add_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [bos] and plain[:1] != [bos]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_token_ids,
            chat_template=template,
            add_bos_token=bool(add_bos),
        )

    def with_chat_template(self, template: str | None) -> Tokenizer:
        """This tokenizer with another chat template (``--chat-template``); None keeps its own."""
        if template is None:
            return self
        return Tokenizer(self._tok, bos_token_id=self._bos_id, eos_token_ids=self._eos_ids,
                         chat_template=template, add_bos_token=self._add_bos)

    def fingerprint(self) -> str:
        """sha256 hex of what decides token ids: the vocabulary in id order, which ids are special,
        BOS/EOS and whether a BOS is added, and the ids of a fixed probe text (splitting,
        normalization, merges). Equal for two processes that tokenize alike, whichever file each
        read (an HF folder or the GGUF of the same model). The chat template is not part of it
        (``--chat-template`` may differ between processes)."""
        import hashlib

        h = hashlib.sha256()
        size = self.vocab_size
        h.update(json.dumps([self._tok.id_to_token(i) for i in range(size)], ensure_ascii=False).encode())
        h.update(json.dumps([sorted(self._special_ids), self._bos_id, list(self._eos_ids), self._add_bos,
                             self._tok.encode(_PROBE, add_special_tokens=False).ids]).encode())
        return h.hexdigest()

    def save_hf(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (loadable by from_hf_folder and HF)."""
        folder = Path(folder)
        self._tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(self.hf_config(), indent=2, ensure_ascii=False))

    def hf_config(self) -> dict[str, Any]:
        """This tokenizer's ``tokenizer_config.json`` (HF's fields: class, BOS/EOS pieces, whether a
        BOS is added, chat template); also what the gateway's GET /tokenizer_info serves."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._piece_or_none(self._bos_id),
            "eos_token": self._piece_or_none(self._eos_ids[0] if self._eos_ids else None),
            "add_bos_token": self._add_bos,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }

    # --- encode / decode ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped Rust tokenizer."""
        return self._tok

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, as stored (byte-level spelling, e.g. ``'Ġthe'``)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise KeyError(f"token id {token_id} out of range (vocab_size={self.vocab_size})")
        return piece

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos:
            return [self._bos_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The exact bytes a byte-level token contributes to a decode (b"" for skipped specials).

        Mirrors the ByteLevel decoder: a piece spelled entirely in the byte alphabet maps back
        byte by byte; any other piece contributes its own UTF-8.
        """
        if not self.is_byte_level:
            raise ValueError("token_bytes() needs a byte-level tokenizer")
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        piece = self.id_to_piece(token_id)
        table = _char_to_byte()
        try:
            return bytes(table[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")

    def _piece_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.id_to_piece(token_id)

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` with the model's own Jinja chat template.

        Same environment as HF (sandboxed, trim_blocks, lstrip_blocks, loop controls, ``tojson``,
        ``raise_exception``, ``strftime_now``), so the prompt is byte-identical to what the model
        was trained on. Template errors raise ``ValueError``.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._piece_or_none(self._bos_id) or "",
                eos_token=self._piece_or_none(self._eos_ids[0] if self._eos_ids else None) or "",
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


def read_chat_template(value: str) -> str:
    """A ``--chat-template`` value as the template text: the contents of the file it names, or the
    value itself when it is a template (as vLLM). ValueError for a file name that does not exist."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long template string is not a valid path
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template; give the path of a "
                     ".jinja file or the template text")


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing stream of generated ids into text deltas, for streaming responses.

    NOTE (algorithm). Byte-level tokenizers: every token maps to a fixed byte string, and the full
    decode is the lossy UTF-8 decode of their concatenation. So the detokenizer keeps a single
    UTF-8 incremental decoder (stdlib, ``errors="replace"``): each step feeds the new tokens'
    bytes and returns what the decoder could finish. A character split across tokens stays inside
    the decoder until its last byte arrives; an invalid sequence becomes U+FFFD exactly where the
    full decode puts it. O(new bytes) per step, and the concatenated deltas plus ``flush()`` equal
    the decode of the generated ids. The prompt's bytes are fed first (output discarded) so a
    character straddling the prompt/generation boundary comes out whole.

    Other tokenizers (e.g. SentencePiece-style, whose decode depends on neighbours): keep a small
    window of already-emitted ids as left context, decode context+pending and context alone, and
    emit the difference. While that difference ends in U+FFFD (an incomplete byte-fallback
    character) the ids stay pending.
    """

    _CONTEXT = 4  # ids of left context for the text-diff path

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        if tokenizer.is_byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._utf8.decode(self._bytes(prompt_ids))
        else:
            self._context = list(prompt_ids[-self._CONTEXT:])
            self._pending: list[int] = []

    def _bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self._tok.token_bytes(i, self._skip) for i in ids)

    def step(self, new_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (may be "")."""
        if self._tok.is_byte_level:
            return self._utf8.decode(self._bytes(new_ids))
        self._pending.extend(new_ids)
        base = self._tok.decode(self._context, self._skip)
        full = self._tok.decode(self._context + self._pending, self._skip)
        if full.endswith("\ufffd"):
            return ""
        return self._advance(base, full)

    def flush(self) -> str:
        """End of stream: return whatever is still held back (an incomplete character as U+FFFD)."""
        if self._tok.is_byte_level:
            return self._utf8.decode(b"", final=True)
        if not self._pending:
            return ""
        base = self._tok.decode(self._context, self._skip)
        return self._advance(base, self._tok.decode(self._context + self._pending, self._skip))

    def _advance(self, base: str, full: str) -> str:
        """Emit ``full`` past the already-emitted ``base``; pending ids become left context."""
        self._context = (self._context + self._pending)[-self._CONTEXT:]
        self._pending = []
        # A decoder that rewrites earlier text (rare) cannot be un-emitted: skip the shared part.
        shared = len(os.path.commonprefix([base, full]))
        return full[shared:]
