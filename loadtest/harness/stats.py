"""What one load level measured: per-request records in, `vllm bench serve`'s summary out.

Definitions (vLLM's benchmark_serving, so numbers compare across tools):
  * TTFT: send to the first content token.
  * ITL: each gap between two consecutive content chunks of a stream (a chunk carrying several
    tokens counts once, as vLLM does).
  * TPOT: (end-to-end - TTFT) / (output tokens - 1), per request with more than one output token.
  * E2EL: send to the end of the stream.
  * Throughput: completed requests, output tokens and input + output tokens per second of the
    level's duration (first send to last end).
  * Goodput: completed requests per second that met every SLO bound given (`Slo`).
Latency percentiles are over completed requests; failures are counted by status instead (HTTP
code, or "connect"/"timeout"/"stream" for a transport error).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

PERCENTILES = (50, 90, 99)


@dataclass
class Record:
    """One request as the client saw it (seconds on the harness's clock)."""

    sent: float
    status: str = "ok"
    """"ok", an HTTP status code ("503"), or "connect" / "timeout" / "stream"."""
    chunk_times: list[float] = field(default_factory=list)
    """When each chunk with content arrived."""
    end: Optional[float] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    """What the server reported reusing (usage.prompt_tokens_details.cached_tokens), 0 if nothing."""
    text: str = ""
    retry_after: Optional[str] = None
    """The Retry-After header of a shed request."""
    scheduled: Optional[float] = None
    """When the schedule said to send it (open loop); `sent` - `scheduled` is the harness's lag."""
    tags: dict = field(default_factory=dict)
    """The workload's tags of the request (LoadRequest.tags; "class" splits the report)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft(self) -> Optional[float]:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2el(self) -> Optional[float]:
        return self.end - self.sent if self.end is not None else None

    @property
    def tpot(self) -> Optional[float]:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


_UNITS = {"ms": 1e-3, "s": 1.0}
SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Slo:
    """Latency bounds a request must meet to count toward goodput, in seconds (None = unbounded);
    `itl` bounds a request's largest gap between chunks."""

    ttft: Optional[float] = None
    tpot: Optional[float] = None
    itl: Optional[float] = None
    e2el: Optional[float] = None

    @classmethod
    def parse(cls, text: str) -> "Slo":
        """`ttft=2s,tpot=100ms` (units s or ms; a bare number is seconds)."""
        bounds: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"(\w+)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|s)?", part)
            if m is None or m.group(1) not in SLO_METRICS:
                raise ValueError(f"bad SLO bound {part!r}: use NAME=VALUE[ms|s] with NAME one of "
                                 f"{', '.join(SLO_METRICS)}, e.g. ttft=2s,tpot=100ms")
            bounds[m.group(1)] = float(m.group(2)) * _UNITS[m.group(3) or "s"]
        return cls(**bounds)

    def __str__(self) -> str:
        return ",".join(f"{k}={_ms(v)}" for k in SLO_METRICS if (v := getattr(self, k)) is not None) or "none"

    def met(self, r: Record) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft, r.ttft), (self.tpot, r.tpot), (self.e2el, r.e2el),
                  (self.itl, max(r.itls, default=0.0)))
        return all(bound is None or (value is not None and value <= bound) for bound, value in checks)


def _ms(seconds: float) -> str:
    return f"{seconds:g}s" if seconds >= 1 else f"{seconds * 1e3:g}ms"


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


@dataclass(frozen=True)
class Summary:
    """One load level, as `vllm bench serve` reports it (plus errors by status and hit rate)."""

    requests: int
    completed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    errors: dict[str, int]
    latency: dict[str, dict[str, float]]
    """{"ttft"|"tpot"|"itl"|"e2el": {"mean", "p50", "p90", "p99"}} in seconds."""
    goodput: Optional[float]
    """Requests/s meeting the SLO (None without one)."""
    slo: str
    retry_after: int = 0
    """Failed requests whose response carried a Retry-After header (shed, told when to come back)."""
    more_goodput: tuple[tuple[str, float], ...] = ()
    """(SLO, requests/s meeting it) for each further SLO asked for (`--slo A;B`)."""
    metrics_hit_rate: Optional[float] = None
    """Prompt tokens served from the target's KV cache over prompt tokens, from its /metrics
    during the level (None when it exports no such counters)."""

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def cached_fraction(self) -> float:
        """Share of completed requests' prompt tokens the server said it reused."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


def parse_slos(text: str) -> list[Slo]:
    """`A;B;...`: one SLO, or several to score each level against (goodput per SLO; the first
    is the primary one, shown in the table)."""
    return [Slo.parse(part) for part in text.split(";") if part.strip()]


def summarize(records: list[Record], slo: Optional[Slo] = None, more: tuple[Slo, ...] = ()) -> Summary:
    done = [r for r in records if r.ok]
    starts = [r.sent for r in records]
    ends = [r.end for r in records if r.end is not None]
    duration = (max(ends) - min(starts)) if starts and ends else 0.0
    series = {"ttft": [r.ttft for r in done if r.ttft is not None],
              "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [g for r in done for g in r.itls],
              "e2el": [r.e2el for r in done]}
    latency = {name: {"mean": sum(v) / len(v) if v else math.nan,
                      **{f"p{p}": percentile(v, p) for p in PERCENTILES}} for name, v in series.items()}
    goodput = None
    if slo is not None and duration > 0:
        goodput = sum(slo.met(r) for r in done) / duration
    more_goodput = tuple((str(o), sum(o.met(r) for r in done) / duration) for o in more) if duration > 0 else ()
    return Summary(requests=len(records), completed=len(done), duration_s=duration,
                   input_tokens=sum(r.prompt_tokens for r in done), output_tokens=sum(r.output_tokens for r in done),
                   cached_tokens=sum(r.cached_tokens for r in done),
                   errors=dict(Counter(r.status for r in records if not r.ok)), latency=latency,
                   goodput=goodput, slo=str(slo) if slo is not None else "none", more_goodput=more_goodput,
                   retry_after=sum(1 for r in records if not r.ok and r.retry_after is not None))
