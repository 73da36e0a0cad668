"""A replica that is an OpenAI-compatible HTTP endpoint (vLLM, llama.cpp server, a hosted API):
`/v1/completions` streamed over SSE, mapped onto kvmesh.engine.v1.GenerateResponse messages.

Such endpoints take text, so the request's `prompt_text` (or its text prompt) is sent; the
messages carry text and log-probabilities but no token ids (TokenLogprob.token_id is 0, `text`
names the token). Usage comes from the stream's usage chunk (`stream_options.include_usage`);
an endpoint that sends none is counted one completion token per streamed chunk. A prompt in
parts is sent as its `prompt_text` too (inline documents in place); one with catalogued or
retrieved documents is refused (INVALID_ARGUMENT): only a kvmesh engine can resolve those.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import httpx

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.rpc.client import call_timeout
from kvmesh.services.router.backends import BackendError, ModelInfo
from kvmesh.services.router.placement import Load
from kvmesh.services.router.prompts import catalog_parts
from kvmesh.services.router.topology import Replica
from kvmesh.sse import json_events

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}
_HTTP_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.FAILED_PRECONDITION,
               403: grpc.StatusCode.FAILED_PRECONDITION, 404: grpc.StatusCode.NOT_FOUND,
               413: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED}


def _status(code: int) -> grpc.StatusCode:
    """The gRPC status an HTTP error means here (5xx and the unknown: the replica is down)."""
    return _HTTP_CODES.get(code, grpc.StatusCode.UNAVAILABLE)


def completion_body(request: engine_pb2.GenerateRequest, model: str, prompt: str) -> dict:
    """The /v1/completions JSON for `request` (vLLM's extensions for top_k, min_p, min_tokens,
    repetition_penalty, ignore_eos, stop_token_ids and structured output, sent only when set)."""
    sp = request.sampling
    body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": True,
                            "stream_options": {"include_usage": True}}
    optional = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                "seed": "seed", "logprobs": "logprobs", "top_k": "top_k"}
    for field, key in optional.items():
        if sp.HasField(field):
            body[key] = getattr(sp, field)
    if sp.stop:
        body["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        body["ignore_eos"] = True
    for field in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens"):
        if sp.HasField(field):
            body[field] = getattr(sp, field)
    if sp.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in sp.logit_bias.items()}
    if sp.HasField("structured_output"):
        body.update(_structured_body(sp.structured_output))
    return body


def _structured_body(so: engine_pb2.StructuredOutput) -> dict[str, Any]:
    """A constraint as vLLM's guided-decoding fields of a completions body."""
    kind = so.WhichOneof("kind")
    if kind == "json_schema":
        return {"guided_json": json.loads(so.json_schema)}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "choice":
        return {"guided_choice": list(so.choice.choices)}
    if kind == "regex":
        return {"guided_regex": so.regex}
    return {"guided_grammar": so.grammar}


def _logprobs(lp: dict | None) -> list[common_pb2.TokenLogprobs]:
    if not lp:
        return []
    tokens = lp.get("tokens") or []
    chosen = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    out = []
    for token, value, top in zip(tokens, chosen, tops):
        alternatives = sorted((top or {}).items(), key=lambda kv: -kv[1])
        out.append(common_pb2.TokenLogprobs(
            chosen=common_pb2.TokenLogprob(logprob=value if value is not None else 0.0,
                                           text=token),
            top=[common_pb2.TokenLogprob(logprob=v, text=t) for t, v in alternatives]))
    return out


class OpenAIBackend:
    """One OpenAI-compatible endpoint (`replica.address` is its base URL, ending in /v1)."""

    can_probe = False
    can_resume = False  # /v1/completions has no way to continue another replica's output

    def __init__(self, replica: Replica, client: httpx.AsyncClient, api_key: str = "") -> None:
        self.replica = replica
        self._client = client
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _fail(self, code: grpc.StatusCode, message: str) -> BackendError:
        return BackendError(self.replica.label, code, message)

    async def generate(self, request: engine_pb2.GenerateRequest, prompt_text: str,
                       timeout: float) -> AsyncIterator[engine_pb2.GenerateResponse]:
        needs_catalog = catalog_parts(request)
        if needs_catalog:
            raise self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                             f"an OpenAI-compatible endpoint cannot resolve "
                             f"{' or '.join(needs_catalog)} prompt parts (documents of the KV "
                             "service's catalog); send the documents inline as text, or use a "
                             "model served by kvmesh engines")
        prompt = prompt_text or (request.text if request.WhichOneof("prompt") == "text" else "")
        if not prompt:
            raise self._fail(grpc.StatusCode.INVALID_ARGUMENT,
                             "an OpenAI-compatible endpoint needs the prompt as text; send "
                             "RouteRequest.prompt_text")
        body = completion_body(request, self.replica.model, prompt)
        timeout = call_timeout(timeout)  # capped by the deadline of the call being served
        rid = request.request_id
        finish, usage, chunks = common_pb2.FINISH_REASON_UNSPECIFIED, None, 0
        # NOTE: the deadline is checked between lines rather than with asyncio.timeout, whose
        # cancellation would land in whichever code the consumer runs while we are suspended.
        deadline = time.monotonic() + timeout
        try:
            async with self._client.stream("POST", f"{self.replica.address}/completions",
                                           json=body, headers=self._headers,
                                           timeout=timeout) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:500]
                    raise self._fail(_status(response.status_code),
                                     f"HTTP {response.status_code}: {text}")
                async for chunk in json_events(response.aiter_lines()):
                    if time.monotonic() > deadline:
                        raise self._fail(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"no complete answer within {timeout:.1f}s")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        finish = _FINISH.get(choice.get("finish_reason") or "", finish)
                        text, logprobs = choice.get("text") or "", _logprobs(choice.get("logprobs"))
                        if text or logprobs:
                            chunks += 1
                            yield engine_pb2.GenerateResponse(request_id=rid, delta=engine_pb2.Delta(
                                text=text, logprobs=logprobs))
        except httpx.TimeoutException as e:
            raise self._fail(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out ({e!r})") from None
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            raise self._fail(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}") from None
        u = usage or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        yield engine_pb2.GenerateResponse(request_id=rid, final=engine_pb2.Final(
            finish_reason=finish or common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=u.get("prompt_tokens", 0),
                                   completion_tokens=u.get("completion_tokens", chunks),
                                   cached_prompt_tokens=cached)))

    async def probe(self, token_ids: Sequence[int], cache_salt: str,
                    timeout: float) -> Load | None:
        return None  # nothing to ask: placement ranks it by this router's in-flight count

    async def model_info(self, timeout: float) -> ModelInfo:
        try:
            response = await self._client.get(f"{self.replica.address}/models",
                                               headers=self._headers,
                                               timeout=call_timeout(timeout))
        except httpx.HTTPError as e:
            raise self._fail(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise self._fail(_status(response.status_code), f"HTTP {response.status_code}")
        models = response.json().get("data") or []
        for card in models:
            if card.get("id") == self.replica.model:
                return ModelInfo(card.get("root") or card["id"], card.get("max_model_len") or 0)
        served = ", ".join(str(card.get("id")) for card in models) or "none"
        raise self._fail(grpc.StatusCode.NOT_FOUND,
                         f"does not serve model {self.replica.model!r} (it serves: {served}); "
                         "fix the #MODEL of this replica in --tiers")

    async def close(self) -> None:
        await self._client.aclose()
