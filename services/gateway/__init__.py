"""The gateway service: kvmesh's public API (OpenAI-compatible HTTP and kvmesh.gateway.v1 gRPC).

Modules, in request order: `config` (flags/env), `auth` (API keys → tenants; `keys` is its CLI),
`openai_schema` and `grpc_servicer` (the two front ends' wire formats → `spec.GenerationRequest`),
`service` (the one request-handling layer: validation, tokenization via `prompts`, admission via
`admission`, router streams via `upstream`), `openai_format` + `sse` + `http_app` (HTTP
rendering, disconnect detection), `tokenization` (vLLM's /tokenize, /detokenize and
/tokenizer_info, answered with the gateway's own tokenizer), `embeddings` (/v1/embeddings from the
KV service's embedding model), `errors` (the one gRPC-code → HTTP mapping), `metrics`, and
`server` / `__main__` (wiring both servers into one asyncio loop).
"""
