"""POST /tokenize, POST /detokenize and GET /tokenizer_info, shaped as vLLM's OpenAI server.

The gateway already holds the served model's tokenizer and chat template (prompts.py; checked at
start to tokenize like every engine tier, model_check.py), so these answer here, without a call
upstream. One tokenizer serves every tier, so `model` (optional, as in vLLM) only has to name a
served model (404 otherwise) and picks the `max_model_len` reported; without it the smallest
context of the served models is reported.

Bodies (unknown fields are refused with a 400 that names them):
- tokenize text: `{"model"?, "prompt": str, "add_special_tokens": true, "return_token_strs": false}`
- tokenize chat: `{"model"?, "messages": [...], "add_generation_prompt": true,
  "add_special_tokens": false, "return_token_strs": false}` (the template writes its own BOS)
- detokenize: `{"model"?, "tokens": [int, ...]}` -> `{"prompt": str}` (special tokens kept)

`/tokenize` answers `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs: the
vocabulary pieces, as HF's convert_ids_to_tokens, when asked; else null). `/tokenizer_info` is
the tokenizer's tokenizer_config.json (class, BOS/EOS pieces, add_bos_token, chat template) plus
`model_max_length`: what lm-eval's `tokenizer_backend=remote` reads.

`tokenize_input`, `detokenize_ids` and `tokenizer_info` are the domain functions; the gRPC API's
Tokenize, Detokenize and GetTokenizerInfo (grpc_servicer.py) answer through them too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kvmesh.services.gateway.errors import invalid
from kvmesh.services.gateway.openai_schema import (
    ChatCompletionBody,
    chat_request,
    decode_object,
    validation_error,
)
from kvmesh.services.gateway.service import Gateway
from kvmesh.services.gateway.spec import ChatTurn, GenerationRequest, Sampling, validate_request

B = TypeVar("B", bound=BaseModel)


class StrictBody(BaseModel):
    """A request body of the non-generation endpoints: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeTextBody(StrictBody):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatBody(StrictBody):
    """POST /tokenize with messages (rendered with the model's chat template)."""

    model: str | None = None
    messages: list[Any]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeBody(StrictBody):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


def decode_body(raw: bytes, schema: type[B]) -> B:
    """A JSON object body checked against `schema`; a 400 naming the parameter otherwise (the
    same decoding limits as the generation endpoints)."""
    data = decode_object(raw)
    if schema is TokenizeTextBody and "messages" in data:
        schema = TokenizeChatBody  # type: ignore[assignment]
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        if errors and errors[0].get("type") == "extra_forbidden":
            name = ".".join(str(p) for p in errors[0]["loc"])
            allowed = ", ".join(schema.model_fields)
            raise invalid(f"unknown parameter '{name}' for this endpoint; it takes {allowed}",
                          name, "unknown_parameter") from e
        raise validation_error(errors) from e


async def _max_model_len(gateway: Gateway, model: str | None) -> int:
    if model is not None:
        return (await gateway.model(model)).max_model_len
    lengths = [m.max_model_len for m in await gateway.models() if m.max_model_len]
    return min(lengths, default=0)


@dataclass(frozen=True)
class Tokenized:
    """A tokenized text or conversation, as both front ends answer it."""

    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None
    """Each token's vocabulary piece, when asked for."""


async def tokenize_input(gateway: Gateway, model: str | None, prompt: str | tuple[ChatTurn, ...], *,
                         add_special_tokens: bool | None = None, add_generation_prompt: bool = True,
                         return_token_strs: bool = False) -> Tokenized:
    """Tokenize a text, or a conversation rendered with the chat template (raises ApiError: 404 for
    an unknown model, 400 for a message a chat completion would refuse). `add_special_tokens`
    None: true for a text, false for a conversation (its template writes its own)."""
    max_model_len = await _max_model_len(gateway, model)
    prompts = gateway.prompts
    if isinstance(prompt, str):
        ids = await prompts.tokenize_text(prompt, add_special_tokens=add_special_tokens is not False)
    else:
        # one tokenizer serves every model: any name passes validate_request's model check
        validate_request(GenerationRequest(kind="chat", model=model or "any", messages=prompt, sampling=Sampling()),
                         gateway.options.limits)
        ids = await prompts.tokenize_chat(prompt, add_generation_prompt=add_generation_prompt,
                                          add_special_tokens=bool(add_special_tokens))
    strs = [prompts.tokenizer.id_to_piece(t) for t in ids] if return_token_strs else None
    return Tokenized(ids, max_model_len, strs)


async def tokenize(gateway: Gateway, raw: bytes) -> dict[str, Any]:
    """The body of POST /tokenize's answer (raises ApiError)."""
    body: TokenizeTextBody | TokenizeChatBody = decode_body(raw, TokenizeTextBody)
    if isinstance(body, TokenizeChatBody):
        try:
            chat = ChatCompletionBody.model_validate({"model": body.model or "any", "messages": body.messages})
        except ValidationError as e:
            raise validation_error(e.errors()) from e
        out = await tokenize_input(gateway, body.model, chat_request(chat).messages,
                                   add_special_tokens=body.add_special_tokens,
                                   add_generation_prompt=body.add_generation_prompt,
                                   return_token_strs=bool(body.return_token_strs))
    else:
        out = await tokenize_input(gateway, body.model, body.prompt, add_special_tokens=body.add_special_tokens,
                                   return_token_strs=bool(body.return_token_strs))
    return {"count": len(out.tokens), "max_model_len": out.max_model_len, "tokens": out.tokens,
            "token_strs": out.token_strs}


async def detokenize_ids(gateway: Gateway, model: str | None, tokens: list[int]) -> str:
    """The text of `tokens`, special tokens kept (raises ApiError: 404 for an unknown model, 400
    naming the first id outside the vocabulary)."""
    if model is not None:
        await gateway.model(model)
    tokenizer = gateway.prompts.tokenizer
    vocab = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"tokens[{bad}] is {tokens[bad]}, outside the vocabulary (0..{vocab - 1})",
                      f"tokens[{bad}]", "invalid_value")
    return tokenizer.decode(tokens, skip_special_tokens=False)


async def detokenize(gateway: Gateway, raw: bytes) -> dict[str, Any]:
    """The body of POST /detokenize's answer (raises ApiError)."""
    body = decode_body(raw, DetokenizeBody)
    return {"prompt": await detokenize_ids(gateway, body.model, body.tokens)}


async def tokenizer_info(gateway: Gateway) -> dict[str, Any]:
    """The body of GET /tokenizer_info: tokenizer_config.json's fields and the context length."""
    info = gateway.prompts.tokenizer.hf_config()
    info["model_max_length"] = await _max_model_len(gateway, None)
    return info
