"""Tokenization in the gateway: the model's tokenizer and chat template, without its weights.

`load_tokenizer` reads only tokenizer metadata: for a GGUF source ('bundled' or a .gguf path) the
file's `tokenizer.*` keys (the tensors are memory-mapped, never read), for a Hugging Face folder
its tokenizer files. `PromptBuilder` turns chat messages or completion prompts into
`PreparedPrompt`s: the token ids sent upstream and the rendered text (sent along for tiers that
are OpenAI-compatible HTTP endpoints, and echoed by completions with `echo`).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.model.tokenizer import Tokenizer
from kvmesh.services.gateway.errors import invalid
from kvmesh.services.gateway.spec import ChatTurn

log = logging.getLogger(__name__)

_THREAD_CHARS = 16384  # longer texts are tokenized off the event loop


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of `source`: 'bundled', a .gguf file, or a Hugging Face folder."""
    from kvmesh.model.loader import bundled_gguf_path, load_tokenizer as load_from_folder

    if source != "bundled" and Path(source).is_dir():
        return load_from_folder(source)
    path = bundled_gguf_path() if source == "bundled" else Path(source)
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"tokenizer source {source!r} is neither 'bundled', a .gguf file "
                                "nor a Hugging Face folder; pass --model")
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    log.info("tokenizer from %s (%d tokens)", path, len(meta.get("tokenizer.ggml.tokens") or ()))
    return Tokenizer.from_gguf_metadata(meta)


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt ready to send: its token ids and its text (chat template applied)."""

    token_ids: tuple[int, ...]
    text: str


class PromptBuilder:
    """Renders and tokenizes prompts for one model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def chat(self, messages: tuple[ChatTurn, ...]) -> PreparedPrompt:
        """The conversation rendered with the model's chat template (generation prompt added)."""
        turns: list[dict[str, Any]] = []
        for m in messages:
            turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                    "content": m.content}
            if m.name:
                turn["name"] = m.name
            turns.append(turn)
        try:
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        except ValueError as e:
            raise invalid(f"cannot render the messages with the model's chat template: {e}",
                          "messages") from e
        # The template writes any BOS itself, so no special tokens are added (as HF does).
        return PreparedPrompt(tuple(await self._encode(text, special=False)), text)

    async def completion(self, prompt: str | tuple[int, ...], index: int) -> PreparedPrompt:
        """A completions prompt: text (tokenized, BOS added when the model wants it) or ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise invalid(f"prompt {index} is empty; send at least one character", "prompt")
            return PreparedPrompt(tuple(await self._encode(prompt, special=True)), prompt)
        if not prompt:
            raise invalid(f"prompt {index} has no tokens; send at least one token id", "prompt")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"prompt {index} has token id {bad} outside the vocabulary "
                          f"(0..{vocab - 1})", "prompt")
        return PreparedPrompt(prompt, self.tokenizer.decode(prompt, skip_special_tokens=False))

    async def _encode(self, text: str, *, special: bool) -> list[int]:
        if len(text) > _THREAD_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, special)
        return self.tokenizer.encode(text, special)
