"""Request limits that more than one service enforces, each declared once.

A limit the engine enforces and the gateway checks first (so that a request the gateway accepts is
not refused later, with a message that names another API's field) lives here and nowhere else.
Plain constants, no imports: the gateway imports this module and must not import torch.
Limits of one service's own API (the gateway's `n`, the KV service's page sizes) stay with it.
"""
from __future__ import annotations

MAX_TEMPERATURE = 2.0
"""Largest sampling temperature (0 means greedy); OpenAI's range is the same [0, 2]."""

MAX_LOGPROBS = 20
"""Most top alternatives returned per token, for generated and for prompt tokens (OpenAI's
chat `top_logprobs` allows the same 20; its legacy completions allow 5, a gateway rule)."""

MAX_STOP_STRINGS = 16
"""Most stop strings per request: every new piece of output text is searched for each one."""

MAX_STOP_STRING_CHARS = 256
"""Longest stop string in characters: output text that may begin one is held back, so this
bounds how late text can be streamed."""

MAX_SEED = 2**64 - 1
"""Largest sampling seed: seeds are unsigned 64-bit (the engine proto's uint64)."""

MAX_RETRIEVE_K = 16
"""Most documents one prompt may retrieve from the catalog: each is fetched and placed in the
prompt. Within the KV service's MAX_SEARCH_K, since a retrieval is one Search."""

MAX_SEARCH_K = 1000
"""Most hits one KV-service Search returns (its proto's SearchRequest.k)."""

MAX_EMBED_TEXTS = 2048
"""Most texts one embeddings request (the gateway's /v1/embeddings, the KV service's Embed) may
carry, as OpenAI's API allows."""

MAX_DRAFT_TOKENS = 16
"""Most draft tokens the engine may be configured to verify per sequence and step; the draft
service's default --max-draft-tokens accepts that many, so an engine at this bound is not refused."""

MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)."""

MAX_LOGIT_BIAS = 100.0
"""logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range): -100 bans a token
in practice, 100 makes it all but certain."""

MAX_CONSTRAINT_CHARS = 65536
"""Longest structured-output specification (JSON schema text, regex, grammar, all choices
together) in characters: each one is compiled at admission."""
