"""Tokenization in the gateway: the model's tokenizer and chat template, without its weights.

`load_tokenizer` reads only tokenizer metadata: for a GGUF source ('bundled' or a .gguf path) the
file's `tokenizer.*` keys (the tensors are memory-mapped, never read), for a Hugging Face folder
its tokenizer files. `PromptBuilder` turns chat messages or completion prompts into
`PreparedPrompt`s: the token ids sent upstream and the rendered text (sent along for tiers that
are OpenAI-compatible HTTP endpoints, and echoed by completions with `echo`).

NOTE (document prompts). A chat request with documents goes upstream in parts, so the engine can
find each document's cached KV by its content wherever it lands. The conversation is rendered
with a one-off sentinel in front of the last user message's content and split there: the tokens
before the sentinel, then each document (inline text tokenized alone, as the catalog tokenizes
it; or a catalog id) followed by a blank line, then retrieval (separator and trailer a blank
line), then the tokens from the user's content on. Each side is tokenized alone, so the ids are
the same whatever the documents are.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from kvmesh.model.tokenizer import Tokenizer
from kvmesh.services.gateway.errors import invalid
from kvmesh import prompt_parts
from kvmesh.prompt_parts import CatalogDocument, InlineDocument, Part, Tokens
from kvmesh.services.gateway.spec import ChatTurn, DocumentRef, Retrieval

log = logging.getLogger(__name__)

_THREAD_CHARS = 16384  # longer texts are tokenized off the event loop


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of `source`: 'bundled', a .gguf file, or a Hugging Face folder."""
    from kvmesh.model.bundled import source_tokenizer

    try:
        return source_tokenizer(source)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"tokenizer {e}; pass --model") from None


DOCUMENT_SEPARATOR = "\n\n"
"""What follows each document (and separates retrieved ones)."""


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt ready to send: its token ids and its text (chat template applied).

    A document prompt has `parts` instead of `token_ids` (see the module NOTE); its `text` has
    the inline documents in place (catalogued and retrieved ones are known only to the engine).
    """

    token_ids: tuple[int, ...]
    text: str
    parts: tuple[Part, ...] = ()

    @property
    def known_tokens(self) -> int:
        """The prompt tokens the gateway knows: a document prompt's plain and inline parts."""
        if not self.parts:
            return len(self.token_ids)
        return sum(len(p.ids) for p in self.parts if isinstance(p, (Tokens, InlineDocument)))

    @property
    def all_known(self) -> bool:
        """Every prompt token is known here (no catalogued or retrieved documents)."""
        return not any(isinstance(p, (CatalogDocument, prompt_parts.Retrieval)) for p in self.parts)


class PromptBuilder:
    """Renders and tokenizes prompts for one model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def chat(self, messages: tuple[ChatTurn, ...], tools: tuple[dict[str, Any], ...] = ()) -> PreparedPrompt:
        """The conversation rendered with the model's chat template (generation prompt added);
        `tools` (OpenAI tool objects) go to the template as its `tools`, as vLLM does."""
        text = self._render(messages, tools=tools)
        # The template writes any BOS itself, so no special tokens are added (as HF does).
        return PreparedPrompt(tuple(await self._encode(text, special=False)), text)

    async def chat_with_documents(self, messages: tuple[ChatTurn, ...],
                                  documents: tuple[DocumentRef, ...],
                                  retrieve: Retrieval | None,
                                  tools: tuple[dict[str, Any], ...] = ()) -> PreparedPrompt:
        """The conversation in parts, documents before the last user message's content (see
        the module NOTE); the request was validated (a user message, well-formed documents)."""
        # spec.validate_request refused requests without a user message: not checked again here
        index = max(i for i, m in enumerate(messages) if m.role == "user")
        user = messages[index]
        sentinel = f"<kvmesh-documents-{uuid.uuid4().hex}>"
        marked = list(messages)
        marked[index] = dataclasses.replace(user, content=sentinel + user.content)
        rendered = self._render(tuple(marked), tools=tools)
        if rendered.count(sentinel) != 1:
            raise invalid("the model's chat template does not render the last user message's "
                          "content exactly once, so documents cannot be placed in it",
                          "documents" if documents else "retrieve")
        before, after = rendered.split(sentinel)
        separator = tuple(await self._encode(DOCUMENT_SEPARATOR, special=False))
        parts: list[Part] = [Tokens(tuple(await self._encode(before, special=False)))]
        text = [before]
        for doc in documents:
            if doc.text is not None:
                parts.append(InlineDocument(tuple(await self._encode(doc.text, special=False))))
                text.append(doc.text + DOCUMENT_SEPARATOR)
            else:
                parts.append(CatalogDocument(doc.id or ""))
            parts.append(Tokens(separator))
        if retrieve is not None:
            query = user.content if retrieve.query is None else retrieve.query
            parts += [prompt_parts.Retrieval(query, retrieve.top_k, separator), Tokens(separator)]
        parts.append(Tokens(tuple(await self._encode(after, special=False))))
        text.append(after)
        return PreparedPrompt((), "".join(text),
                              tuple(p for p in parts if not isinstance(p, Tokens) or p.ids))

    async def tokenize_chat(self, messages: tuple[ChatTurn, ...], *, add_generation_prompt: bool,
                            add_special_tokens: bool) -> list[int]:
        """The ids of the conversation as `chat` renders it (POST /tokenize): the generation prompt
        and a BOS on top of the template's own as asked."""
        text = self._render(messages, add_generation_prompt=add_generation_prompt)
        return await self._encode(text, special=add_special_tokens)

    async def tokenize_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids of plain text (POST /tokenize), a BOS in front when asked and the model wants it."""
        return await self._encode(text, special=add_special_tokens)

    def _render(self, messages: tuple[ChatTurn, ...], *, add_generation_prompt: bool = True,
                tools: tuple[dict[str, Any], ...] = ()) -> str:
        turns: list[dict[str, Any]] = []
        for m in messages:
            turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                    "content": m.content}
            if m.name:
                turn["name"] = m.name
            if m.tool_calls:
                turn["tool_calls"] = [dict(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            turns.append(turn)
        try:
            extra = {"tools": list(tools)} if tools else {}
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, **extra)
        except ValueError as e:
            raise invalid(f"cannot render the messages with the model's chat template: {e}",
                          "messages") from e

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
