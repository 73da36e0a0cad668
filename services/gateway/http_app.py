"""The OpenAI-compatible HTTP front end: a thin FastAPI adapter over `service.Gateway`.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions
(SSE when `stream`), POST /v1/embeddings (embeddings.py), POST /tokenize, POST /detokenize,
GET /tokenizer_info (tokenization.py), GET /health, GET /metrics, GET /version, GET /openapi.json
and its Swagger UI at GET /docs. Every error is OpenAI's body with the status
`errors` maps it to — FastAPI's own validation errors and unknown routes included. A SERVER span
per request (W3C `traceparent` honoured) is current while the request runs, so the router call
made for it joins the same trace.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh import __version__
from kvmesh.errors import KvmeshError
from kvmesh.services.gateway import tokenization
from kvmesh.services.gateway.auth import bearer_token
from kvmesh.services.gateway.embeddings import EmbeddingModel, Embeddings, require
from kvmesh.services.gateway.errors import ApiError, error_type, to_api_error
from kvmesh.services.gateway.openai_format import DONE, Formatter, sse
from kvmesh.services.gateway.openai_schema import (
    chat_request,
    completion_request,
    parse_body,
    validation_error,
)
from kvmesh.services.gateway.openapi import openapi_document
from kvmesh.services.gateway.service import Gateway, Generation
from kvmesh.services.gateway.sse import CLIENT_CLOSED, ClientGone, EventStream, race_disconnect
from kvmesh.telemetry import Telemetry, extract_context

_UNTRACED = ("/health", "/metrics", "/version")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


class TraceMiddleware:
    """Opens a SERVER span per HTTP request (health and metrics excepted) and makes it current,
    with `telemetry`'s provider (kvmesh.telemetry's NOTE) for the router call made for it."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNTRACED:
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        method, path = scope["method"], scope["path"]
        span = self.telemetry.tracer("kvmesh.gateway").start_span(
            f"{method} {path}", context=extract_context(headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path})
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = otel_context.attach(self.telemetry.context(trace.set_span_in_context(span)))
        try:
            await self.app(scope, receive, send_status)
        finally:
            otel_context.detach(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            span.end()


def create_app(gateway: Gateway, telemetry: Telemetry, *, serve_metrics: bool = True,
               embeddings: Embeddings | None = None) -> FastAPI:
    """The HTTP application for `gateway`; spans go to `telemetry`'s provider and /metrics serves
    its registry; `embeddings` (the KV service's model) serves /v1/embeddings when given."""
    # FastAPI's own OpenTelemetry (newer releases) is off: TraceMiddleware opens the one SERVER
    # span per request, on any FastAPI version, and leaves probes untraced.
    # /docs is FastAPI's Swagger UI over the published document (openapi.py): the page is served
    # here, its script and stylesheet come from FastAPI's default public CDN, fetched by the
    # browser (the gateway itself fetches nothing). ReDoc stays off: one viewer is enough.
    app = FastAPI(title="kvmesh gateway", summary="OpenAI-compatible API of kvmesh",
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  telemetry={"tracing": False, "metrics": False, "logs": False,
                             "operation_spans": False})
    document = openapi_document()
    app.openapi = lambda: document  # built from the body models (see openapi.py), not inferred
    app.add_middleware(TraceMiddleware, telemetry=telemetry)
    retry_after = gateway.options.retry_after_s

    @app.exception_handler(KvmeshError)
    async def _domain_error(request: Request, exc: KvmeshError) -> JSONResponse:
        return error_response(to_api_error(exc, retry_after=retry_after))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (f"unknown URL {request.method} {request.url.path}" if exc.status_code == 404
                   else str(exc.detail))
        return JSONResponse({"error": {"message": message, "type": error_type(exc.status_code),
                                       "param": None, "code": None}},
                            status_code=exc.status_code, headers=exc.headers)

    def authenticate(request: Request) -> str:
        tenant = gateway.authenticate(bearer_token(request.headers.get("authorization")))
        trace.get_current_span().set_attribute("kvmesh.tenant", tenant.name)
        return tenant.name

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = await gateway.health()
        return JSONResponse({"status": problem or "ok"}, status_code=503 if problem else 200)

    if serve_metrics:
        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(generate_latest(telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        authenticate(request)
        data = [_model(m) for m in await gateway.models()]
        embedder = await embeddings.listed() if embeddings is not None else None
        if embedder is not None:
            data.append(_embedding_model(embedder))
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        authenticate(request)
        embedder = await embeddings.listed() if embeddings is not None else None
        if embedder is not None and model_id == embedder.name:
            return _embedding_model(embedder)
        return _model(await gateway.model(model_id))

    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> dict[str, Any]:
        authenticate(request)
        return await require(embeddings).create(await request.body())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        authenticate(request)
        return await tokenization.tokenize(gateway, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        authenticate(request)
        return await tokenization.detokenize(gateway, await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        authenticate(request)
        return await tokenization.tokenizer_info(gateway)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(gateway, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(gateway, request, "chat")

    return app


def _model(m: Any) -> dict[str, Any]:
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "kvmesh",
            "root": m.root, "max_model_len": m.max_model_len, "kind": "generation"}


def _embedding_model(m: EmbeddingModel) -> dict[str, Any]:
    """The KV service's embedding model as a /v1/models entry: `kind` says it serves
    /v1/embeddings only, `dimensions` its vectors' width."""
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "kvmesh",
            "root": m.name, "max_model_len": m.max_tokens, "kind": "embedding",
            "dimensions": m.dimensions}


async def _generate(gateway: Gateway, request: Request, kind: Literal["completion", "chat"]
                    ) -> Response:
    """Authenticate, parse, start, then stream or collect; every outcome is recorded once."""
    arrival = time.perf_counter()
    retry_after = gateway.options.retry_after_s
    tenant_name, model = "unauthenticated", ""

    def record(status: int) -> None:
        gateway.record(request.url.path, status, tenant_name, arrival, model)

    try:
        tenant = gateway.authenticate(bearer_token(request.headers.get("authorization")))
        tenant_name = tenant.name
        trace.get_current_span().set_attribute("kvmesh.tenant", tenant.name)
        body = parse_body(await request.body(), kind)
        req = chat_request(body) if kind == "chat" else completion_request(body)  # type: ignore[arg-type]
        model = req.model
        stream = bool(body.stream)
        include_usage = bool(stream and body.stream_options and body.stream_options.include_usage)
        generation = await gateway.start(req, tenant, endpoint=request.url.path, arrival=arrival)
    except Exception as e:
        err = to_api_error(e, retry_after=retry_after)
        record(err.status)
        return error_response(err)
    fmt = Formatter(kind, generation.id, generation.created, req.model,
                    logprobs=req.sampling.logprobs is not None, include_usage=include_usage,
                    tool_calls=req.tool_calls)
    run = _Run(generation, fmt, record, retry_after)
    try:
        if stream:  # wait for the first delta, so that early failures get a real status
            first = await race_disconnect(request.receive, run.first())
        else:
            result = await race_disconnect(request.receive, run.collect())
    except ClientGone:
        await run.close(disconnected=True)
        return Response(status_code=CLIENT_CLOSED)
    except BaseException as e:
        if not isinstance(e, Exception):
            await generation.aclose()
            raise
        err = to_api_error(e, retry_after=retry_after)
        run.status = err.status
        await run.close(disconnected=False)
        return error_response(err)
    if not stream:
        await run.close(disconnected=False)
        return JSONResponse(result)
    return EventStream(run.events(first), run.close)


class _Run:
    """One admitted HTTP request: its deltas rendered, and its one close (release + record)."""

    def __init__(self, generation: Generation, fmt: Formatter, record: Callable[[int], None],
                 retry_after: int) -> None:
        self.generation = generation
        self.deltas = generation.deltas()
        self.fmt = fmt
        self.record = record
        self.retry_after = retry_after
        self.status = 200

    async def first(self) -> Any:
        try:
            return await self.deltas.__anext__()
        except StopAsyncIteration:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the router sent no output; retry",
                           retry_after=self.retry_after) from None

    async def collect(self) -> dict[str, Any]:
        async for delta in self.deltas:
            self.fmt.add(delta)
        return self.fmt.response(self.generation.usage)

    async def events(self, first: Any) -> AsyncIterator[bytes]:
        """SSE bytes: chunks, the usage chunk if asked, an error event if one came, [DONE]."""
        try:
            for chunk in self.fmt.chunks(first):
                yield sse(chunk)
            async for delta in self.deltas:
                for chunk in self.fmt.chunks(delta):
                    yield sse(chunk)
            if self.fmt.include_usage:
                yield sse(self.fmt.usage_chunk(self.generation.usage))
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            err = to_api_error(e, retry_after=self.retry_after)
            self.status = err.status
            yield sse(err.body())
        yield DONE

    async def close(self, disconnected: bool) -> None:
        """Cancel what still runs upstream, release the slot, count the outcome."""
        await self.generation.aclose()
        self.record(CLIENT_CLOSED if disconnected else self.status)
