"""Sending fuzzed bytes to a gRPC service and judging the answers.

`RawCaller` calls any method of a service with request bytes as they are (an identity serializer,
so a request need not be a valid message) on a blocking channel, reads the whole answer, parses
every response message with the method's output type, and returns the status. `fuzz` drives it with
a Hypothesis strategy of cases and keeps a `Tally`; a case fails when the status is one a client
must never see for its input (UNKNOWN, INTERNAL, DATA_LOSS: a server bug), when the call outlives
`CALL_TIMEOUT_S` (a hang), or when a failed call carries no message saying what to fix.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from fuzz.proto_strategies import deep_groups, length_delimited

BAD_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS})
"""Statuses that mean the server failed, whatever the request was."""
CALL_TIMEOUT_S = 60.0
"""Deadline of one fuzz call: far past what any answer takes, so running into it means a hang."""
FAST_CASES = 300
FULL_CASES = int(os.environ.get("KVMESH_FUZZ_CASES", "10000"))
FULL = os.environ.get("KVMESH_FUZZ_FULL") == "1"
"""The full runs (FULL_CASES per API) happen only when KVMESH_FUZZ_FULL=1 (tests/fuzz/conftest.py)."""

_PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
metadata = st.lists(st.one_of(
    st.tuples(st.just("authorization"), st.one_of(st.just("Bearer any-key"), _PRINTABLE)),
    st.tuples(st.just("traceparent"), st.one_of(
        st.just("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), _PRINTABLE)),
    st.tuples(st.just("tracestate"), _PRINTABLE),
    st.tuples(st.just("x-fuzz-bin"), st.binary(max_size=40)),
), max_size=3)
"""Call metadata: API keys, W3C trace context (every server parses it) and binary headers."""


@dataclass(frozen=True)
class Case:
    """One call: the method, its request bytes (a list of them for a client stream), metadata."""

    method: MethodDescriptor
    request: bytes | tuple[bytes, ...]
    metadata: tuple[tuple[str, str | bytes], ...] = ()

    def __repr__(self) -> str:
        return f"Case({self.method.full_name}, request={self.request!r}, metadata={self.metadata!r})"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # how Hypothesis shows a failing case
        printer.text(repr(self))


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: int


def _identity(raw: bytes) -> bytes:
    return raw


class RawCaller:
    """Calls the methods of `service` at `address` with raw request bytes (see the module docstring)."""

    def __init__(self, address: str, service: ServiceDescriptor) -> None:
        self.address = address
        self.service = service
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self._calls: dict[str, Callable] = {}

    def close(self) -> None:
        self.channel.close()

    def _callable(self, method: MethodDescriptor) -> Callable:
        found = self._calls.get(method.name)
        if found is None:
            path = f"/{self.service.full_name}/{method.name}"
            parse = GetMessageClass(method.output_type).FromString
            kind = {(False, False): self.channel.unary_unary, (False, True): self.channel.unary_stream,
                    (True, False): self.channel.stream_unary, (True, True): self.channel.stream_stream}[
                (method.client_streaming, method.server_streaming)]
            found = self._calls[method.name] = kind(path, request_serializer=_identity,
                                                    response_deserializer=parse)
        return found

    def call(self, case: Case) -> Outcome:
        method = case.method
        request = iter(case.request) if method.client_streaming else case.request
        try:
            answer = self._callable(method)(request, timeout=CALL_TIMEOUT_S, metadata=case.metadata)
            responses = sum(1 for _ in answer) if method.server_streaming else 1
        except grpc.RpcError as e:
            return Outcome(e.code(), e.details() or "", 0)
        return Outcome(grpc.StatusCode.OK, "", responses)

    def healthy(self) -> bool:
        """Whether the server's grpc.health.v1 answers SERVING."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
        return answer.status == health_pb2.HealthCheckResponse.SERVING


@dataclass
class Tally:
    """Statuses seen, by method and code."""

    name: str
    by_method: Counter = field(default_factory=Counter)

    def record(self, method: str, code: grpc.StatusCode) -> None:
        self.by_method[(method, code.name)] += 1

    @property
    def by_code(self) -> Counter:
        out: Counter = Counter()
        for (_, code), n in self.by_method.items():
            out[code] += n
        return out

    @property
    def total(self) -> int:
        return sum(self.by_method.values())

    def report(self) -> str:
        codes = ", ".join(f"{code} {n}" for code, n in self.by_code.most_common())
        methods = "; ".join(f"{m} {c} {n}" for (m, c), n in sorted(self.by_method.items()))
        return f"[fuzz] {self.name}: {self.total} calls: {codes}\n[fuzz]   by method: {methods}"


def problem(outcome: Outcome) -> str | None:
    """Why `outcome` is a server bug, or None."""
    if outcome.code in BAD_CODES:
        return f"{outcome.code.name}: {outcome.details}"
    if outcome.code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {CALL_TIMEOUT_S} s (a hang): {outcome.details}"
    if outcome.code is not grpc.StatusCode.OK and not outcome.details.strip():
        return f"{outcome.code.name} without a message"
    if "metadata size exceeds" in outcome.details:  # the client's grpc replaced the server's status
        return f"a status message too long for the client to read ({outcome.details})"
    return None


def raw_cases(service: ServiceDescriptor) -> list[Case]:
    """For every method of `service`, requests sent before the drawn cases of every run: bytes
    protobuf refuses, a length past the end, 20,000 nested groups, a string field holding a lone
    surrogate, and one holding 1 MiB of text; for a client stream, each alone and after an empty
    message."""
    out = []
    for m in service.methods:
        bad = [b"\xff", b"\x0a\xff", deep_groups(20_000)]
        strings = [f for f in m.input_type.fields if f.type == f.TYPE_STRING]
        if strings:
            bad.append(length_delimited(strings[0].number, b"\xed\xa0\x80"))
            bad.append(length_delimited(strings[0].number, b"a " * (1 << 19)))
        for raw in bad:
            out.append(Case(m, (raw,) if m.client_streaming else raw))
            if m.client_streaming:
                out.append(Case(m, (b"", raw)))
    return out


def fuzz(caller: RawCaller, cases: st.SearchStrategy[Case], n: int, tally: Tally) -> None:
    """Send the `raw_cases` of the caller's service, then `n` cases drawn from `cases`
    (derandomized: the same cases every run); fail on the first answer that `problem` rejects,
    after Hypothesis shrinks it to a minimal case."""

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate, Phase.shrink),
              report_multiple_bugs=False)
    @given(case=cases)
    def one(case: Case) -> None:
        outcome = caller.call(case)
        tally.record(case.method.name, outcome.code)
        bug = problem(outcome)
        assert bug is None, f"{caller.service.full_name}/{case.method.name}: {bug}"

    for case in raw_cases(caller.service):
        one = example(case=case)(one)
    try:
        one()
    finally:
        print(tally.report())
