"""OpenAI response bodies and SSE chunks, built from the domain's `ChoiceDelta`s and `Usage`.

`Formatter` knows one request's id, model and options; `chunks(delta)` gives the SSE chunk
objects for a delta, `add(delta)` accumulates it for a non-streaming response, and `response()`
builds that response. Completions use the legacy `logprobs` object (tokens, token_logprobs,
top_logprobs, text_offset — offsets count characters from the start of the choice's text, echoed
prompt included); chat uses `logprobs.content` entries with bytes and top_logprobs.

Requests that reused cached KV, or had documents, get a kvmesh extension object next to `usage`
(in the response, and in the streamed usage chunk) saying what was reused and how:
``"kvmesh": {"reuse": {"storage": "exact", "exact": true, "prefix_cache_tokens": P,
"kv_service_tokens": S}}``, with ``"document_ids": [...], "blended_tokens": N,
"recomputed_tokens": M`` for documents.

A chat request with tool_choice "required" or a named function (`tool_calls` set) gets its
constrained output as `message.tool_calls` with finish_reason "tool_calls" and null content;
streamed, the choice's text is held back and sent as one `tool_calls` delta when it finishes. An
output that does not parse (cut by max_tokens) stays text, with its own finish_reason. A storage other than "exact" names the lossy path (a KV
codec, or the blend with its recompute ratio) that the request or its tenant opted into; a
``"fallback"`` string names a lossy path that was asked for and not served (the engine's
guardrail estimated it over the request's quality budget), whose reuse was exact instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.services.gateway.spec import ChoiceDelta, Kind, TokenLogprob, Usage
from kvmesh.services.gateway.structured import ToolCallOutput, tool_call_result

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def kvmesh_body(usage: Usage) -> dict[str, Any] | None:
    """The kvmesh extension object of a response (see the module docstring), or None."""
    body: dict[str, Any] = {}
    reuse = usage.reuse()
    if reuse is not None:
        body["reuse"] = {"storage": reuse.storage, "exact": reuse.exact,
                         "prefix_cache_tokens": reuse.prefix_cache_tokens,
                         "kv_service_tokens": reuse.kv_service_tokens}
        if reuse.fallback:
            body["reuse"]["fallback"] = reuse.fallback
    if usage.documents is not None:
        d = usage.documents
        body.update({"document_ids": list(d.document_ids), "blended_tokens": d.blended_tokens,
                     "recomputed_tokens": d.recomputed_tokens})
    return body or None


def _with_usage(body: dict[str, Any], usage: Usage) -> dict[str, Any]:
    body["usage"] = usage_body(usage)
    extension = kvmesh_body(usage)
    if extension is not None:
        body["kvmesh"] = extension
    return body


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                             for t in lp.top]}


@dataclass
class _Choice:
    """What a non-streaming response accumulates for one choice, and its text offset."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0


class Formatter:
    """Builds the chunks and the response of one request (see the module docstring)."""

    def __init__(self, kind: Kind, request_id: str, created: int, model: str, *,
                 logprobs: bool, include_usage: bool, tool_calls: ToolCallOutput | None = None) -> None:
        self.kind = kind
        self.id = request_id
        self.created = created
        self.model = model
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.tool_calls = tool_calls if kind == "chat" else None
        self._choices: dict[int, _Choice] = {}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _choice(self, index: int) -> _Choice:
        return self._choices.setdefault(index, _Choice())

    def _legacy_logprobs(self, state: _Choice, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The completions `logprobs` object for `entries`, advancing the choice's offset."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for lp in entries:
            out["tokens"].append(lp.token)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(None if lp.logprob is None
                                       else {t.token: t.logprob for t in lp.top})
            out["text_offset"].append(state.offset)
            state.offset += len(lp.token)
        return out

    def _delta_text_and_logprobs(self, delta: ChoiceDelta) -> tuple[str, list[TokenLogprob]]:
        text, entries = delta.text, list(delta.logprobs)
        if delta.echo is not None:
            text = delta.echo.text + text
            entries = list(delta.echo.logprobs) + entries
        return text, entries

    # --- streaming ----------------------------------------------------------------------------

    def chunks(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The SSE chunk objects for one delta (chat may need two: content, then finish)."""
        state = self._choice(delta.index)
        text, entries = self._delta_text_and_logprobs(delta)
        if self.kind == "completion":
            choice = {"index": delta.index, "text": text,
                      "logprobs": self._legacy_logprobs(state, entries) if self.logprobs else None,
                      "finish_reason": delta.finish_reason}
            return [self._chunk("text_completion", choice)]
        if self.tool_calls is not None:
            return self._tool_chunks(state, delta, text, entries)
        out = []
        body: dict[str, Any] = {}
        if delta.first:
            body["role"] = "assistant"
        if text or delta.first:
            body["content"] = text
        if body or entries:
            logprobs = ({"content": [_chat_logprob(e) for e in entries], "refusal": None}
                        if self.logprobs else None)
            out.append(self._chunk("chat.completion.chunk", {
                "index": delta.index, "delta": body, "logprobs": logprobs, "finish_reason": None}))
        if delta.finish_reason is not None:
            out.append(self._chunk("chat.completion.chunk", {
                "index": delta.index, "delta": {}, "logprobs": None,
                "finish_reason": delta.finish_reason}))
        return out

    def _tool_chunks(self, state: _Choice, delta: ChoiceDelta, text: str,
                     entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        """A tool-call choice streamed: the role first, the calls when complete (module docstring)."""
        state.text.append(text)
        state.logprobs.extend(entries)
        out = []
        if delta.first:
            out.append(self._chunk("chat.completion.chunk", {
                "index": delta.index, "delta": {"role": "assistant", "content": None},
                "logprobs": None, "finish_reason": None}))
        if delta.finish_reason is None:
            return out
        content, calls, reason = self._tool_message(state, delta.finish_reason)
        body: dict[str, Any] = ({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                                if calls is not None else {"content": content})
        logprobs = ({"content": [_chat_logprob(e) for e in state.logprobs], "refusal": None}
                    if self.logprobs else None)
        out.append(self._chunk("chat.completion.chunk", {
            "index": delta.index, "delta": body, "logprobs": logprobs, "finish_reason": None}))
        out.append(self._chunk("chat.completion.chunk", {
            "index": delta.index, "delta": {}, "logprobs": None, "finish_reason": reason}))
        return out

    def _tool_message(self, state: _Choice, finish_reason: str | None
                      ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """(content, tool_calls, finish_reason) of a finished tool-call choice."""
        return tool_call_result("".join(state.text), finish_reason, self.tool_calls)

    def _chunk(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The final `choices: []` chunk carrying usage (stream_options.include_usage)."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return _with_usage({**self._head(obj), "choices": []}, usage)

    # --- non-streaming ------------------------------------------------------------------------

    def add(self, delta: ChoiceDelta) -> None:
        """Accumulate one delta for `response()`."""
        state = self._choice(delta.index)
        text, entries = self._delta_text_and_logprobs(delta)
        state.text.append(text)
        state.logprobs.extend(entries)
        if delta.finish_reason is not None:
            state.finish_reason = delta.finish_reason

    def response(self, usage: Usage) -> dict[str, Any]:
        """The whole non-streaming response body."""
        choices = []
        for index in sorted(self._choices):
            state = self._choices[index]
            text = "".join(state.text)
            if self.kind == "completion":
                state.offset = 0
                logprobs = self._legacy_logprobs(state, state.logprobs) if self.logprobs else None
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": state.finish_reason})
            else:
                logprobs = ({"content": [_chat_logprob(e) for e in state.logprobs],
                             "refusal": None} if self.logprobs else None)
                message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
                reason = state.finish_reason
                if self.tool_calls is not None:
                    content, calls, reason = self._tool_message(state, reason)
                    message["content"] = content
                    if calls is not None:
                        message["tool_calls"] = calls
                choices.append({"index": index, "message": message,
                                "logprobs": logprobs, "finish_reason": reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return _with_usage({**self._head(obj), "choices": choices}, usage)
