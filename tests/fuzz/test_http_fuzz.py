"""The gateway's HTTP API fuzzed from its own published schema (GET /openapi.json).

The real gateway (uvicorn + FastAPI, GatewayHarness) runs in front of the fake router, and the
schema is read from the running server, so what is fuzzed is what clients are told. Two sources
of requests, each sending `n_cases`:

- schemathesis: cases for every operation of the document, half positive (bodies the schema
  admits; the model is a served one half of the time, so requests reach the router) and half
  negative (bodies that break it);
- tests/fuzz/http_bodies.py: what schemathesis does not send (numbers past float range, NaN,
  thousands of digits or nesting levels, lone surrogates, bodies that are not JSON or not UTF-8,
  hostile headers and path ids).

An answer fails the test when it is a 5xx, or a 4xx that is not an OpenAI error body with a
message; afterwards the gateway must still answer GET /health 200 and a valid completion.
`pytest -s` prints the counts by status.
"""
from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fuzz.http_bodies import body_schemas, headers, model_ids, raw_bodies
from gateway_utils import GatewayHarness

SERVED = ("tiny", "cascade")


@pytest.fixture(scope="module")
def gateway():
    with GatewayHarness() as h:
        h.root = f"http://127.0.0.1:{h.http_port}"
        yield h


@pytest.fixture(scope="module")
def document(gateway) -> dict:
    return httpx.get(gateway.root + "/openapi.json").json()


class Tally:
    """HTTP statuses seen, by operation."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: Counter = Counter()

    def record(self, operation: str, status: int) -> None:
        self.counts[(operation, status)] += 1

    def report(self) -> str:
        by_status: Counter = Counter()
        for (_, status), n in self.counts.items():
            by_status[status] += n
        statuses = ", ".join(f"{s} {n}" for s, n in sorted(by_status.items()))
        ops = "; ".join(f"{op} {s} {n}" for (op, s), n in sorted(self.counts.items()))
        return (f"[fuzz] {self.name}: {sum(by_status.values())} requests: {statuses}\n"
                f"[fuzz]   by operation: {ops}")


def problem(status: int, content_type: str, body: bytes) -> str | None:
    """Why an answer is a server bug, or None."""
    if status >= 500:
        return f"HTTP {status}: {body[:500]!r}"
    if status >= 400:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"HTTP {status} without an OpenAI error body ({content_type}): {body[:300]!r}"
        if not isinstance(message, str) or not message:
            return f"HTTP {status} error body without a message: {body[:300]!r}"
    return None


def _settings(n: int):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink))


def check_still_serving(gateway) -> None:
    assert httpx.get(gateway.root + "/health").status_code == 200
    ok = httpx.post(gateway.root + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert ok.status_code == 200, ok.text


def _served_model(required: dict[str, list[str]]):
    """A flatmap over schemathesis cases: half of them name a served model (in the body or the
    path) and keep at most two optional body properties (`required`: path -> the properties its
    body needs), so that more of them get past validation to the router."""
    @st.composite
    def served(draw, case):
        if draw(st.booleans()):
            body = case.body
            if isinstance(body, dict) and "model" in body:
                kept = draw(st.sets(st.sampled_from(sorted(body)), max_size=2))
                needed = required.get(case.operation.path, ())
                case.body = {k: v for k, v in body.items() if k in needed or k in kept}
                case.body["model"] = draw(st.sampled_from(SERVED))
            if case.path_parameters and "model_id" in case.path_parameters:
                case.path_parameters["model_id"] = draw(st.sampled_from(SERVED))
        return case
    return served


def test_schemathesis_cases(gateway, document, n_cases):
    schema = schemathesis.openapi.from_dict(document)
    session = requests.Session()
    tally = Tally("gateway HTTP (schemathesis)")
    required = {path: body.get("required", []) for path, body in body_schemas(document).items()}
    positive = schema.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE).flatmap(
        _served_model(required))
    negative = schema.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE)

    def run(strategy, n: int, mode: str) -> None:
        @_settings(n)
        @given(case=strategy)
        def one(case) -> None:
            response = case.call(base_url=gateway.root, session=session, timeout=60)
            tally.record(f"{mode} {case.operation.label}", response.status_code)
            bug = problem(response.status_code, response.headers.get("content-type", ""), response.content)
            assert bug is None, f"{case.method} {case.formatted_path} body={case.body!r}: {bug}"
        one()

    try:
        run(positive, n_cases // 2, "positive")
        run(negative, n_cases - n_cases // 2, "negative")
    finally:
        print(tally.report())
        session.close()
    check_still_serving(gateway)


def test_hostile_requests(gateway, document, n_cases):
    posts = body_schemas(document)
    assert posts, "the published schema has no POST operations to fuzz"
    cases = st.one_of(
        *(st.tuples(st.just("POST"), st.just(path), raw_bodies(schema), headers) for path, schema in posts.items()),
        st.tuples(st.just("GET"), model_ids.map(lambda i: f"/v1/models/{i}"), st.just(b""), headers),
        st.tuples(st.sampled_from(["PUT", "DELETE", "PATCH", "GET"]), st.sampled_from(sorted(posts)),
                  st.just(b"{}"), headers))
    tally = Tally("gateway HTTP (hostile bodies)")

    with httpx.Client(base_url=gateway.root, timeout=60) as client:
        @_settings(n_cases)
        @given(case=cases)
        def one(case) -> None:
            method, path, body, head = case
            response = client.request(method, path, content=body, headers=head)
            operation = "GET /v1/models/{model_id}" if path.startswith("/v1/models/") else f"{method} {path}"
            tally.record(operation, response.status_code)
            bug = problem(response.status_code, response.headers.get("content-type", ""), response.content)
            assert bug is None, f"{method} {path} body={body[:300]!r} headers={head}: {bug}"
        try:
            one()
        finally:
            print(tally.report())
    check_still_serving(gateway)
