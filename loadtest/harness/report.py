"""Reporting load levels: a table like `vllm bench serve`'s, JSON rows, and PNG plots."""
from __future__ import annotations

import math
import statistics
from typing import Optional

from kvmesh.loadtest.harness.stats import PERCENTILES, Summary

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def rows(summary: Summary, **params) -> list[dict]:
    """One level as benchmark rows {params..., metric, value, unit} (latencies in ms)."""
    out = [
        {**params, "metric": "requests", "value": summary.requests, "unit": "requests"},
        {**params, "metric": "completed", "value": summary.completed, "unit": "requests"},
        {**params, "metric": "duration", "value": summary.duration_s, "unit": "s"},
        {**params, "metric": "request_throughput", "value": summary.request_throughput, "unit": "req/s"},
        {**params, "metric": "output_throughput", "value": summary.output_throughput, "unit": "tok/s"},
        {**params, "metric": "total_token_throughput", "value": summary.total_token_throughput, "unit": "tok/s"},
        {**params, "metric": "input_tokens", "value": summary.input_tokens, "unit": "tokens"},
        {**params, "metric": "output_tokens", "value": summary.output_tokens, "unit": "tokens"},
        {**params, "metric": "cached_prompt_fraction", "value": summary.cached_fraction, "unit": "fraction"},
    ]
    for key, _ in LATENCIES:
        for stat, value in summary.latency[key].items():
            out.append({**params, "metric": f"{stat}_{key}", "value": value * 1e3, "unit": "ms"})
    if summary.metrics_hit_rate is not None:
        out.append({**params, "metric": "kv_hit_rate_metrics", "value": summary.metrics_hit_rate, "unit": "fraction"})
    if summary.goodput is not None:
        out.append({**params, "slo": summary.slo, "metric": "goodput", "value": summary.goodput, "unit": "req/s"})
    for slo, value in summary.more_goodput:
        out.append({**params, "slo": slo, "metric": "goodput", "value": value, "unit": "req/s"})
    for status, n in sorted(summary.errors.items()):
        out.append({**params, "status": status, "metric": "errors", "value": n, "unit": "requests"})
    if summary.errors:
        out.append({**params, "metric": "errors_with_retry_after", "value": summary.retry_after, "unit": "requests"})
    return out


def peak_goodput(levels: list[tuple[dict, Summary]]) -> list[dict]:
    """For each system and workload measured in repeats (params with "repeat"): its peak goodput
    in each repeat (its best level), as rows of their min, median and max. [] without repeats or
    an SLO."""
    best: dict[tuple, dict[int, float]] = {}
    for params, s in levels:
        if "repeat" not in params or params.get("class") or s.goodput is None:
            continue
        key = (params.get("system"), params.get("workload"), params.get("sessions"), s.slo)
        per = best.setdefault(key, {})
        per[params["repeat"]] = max(per.get(params["repeat"], 0.0), s.goodput)
    out = []
    for (system, workload, sessions, slo), per in best.items():
        peaks = sorted(per.values())
        params = {k: v for k, v in (("system", system), ("workload", workload), ("sessions", sessions),
                                    ("slo", slo), ("repeats", len(peaks))) if v is not None}
        for stat, value in (("min", peaks[0]), ("median", statistics.median(peaks)), ("max", peaks[-1])):
            out.append({**params, "metric": f"peak_goodput_{stat}", "value": value, "unit": "req/s"})
    return out


def peak_text(peaks: list[dict]) -> str:
    """peak_goodput's rows as one line per system: median [min / max] over the repeats."""
    stats: dict[tuple, dict[str, float]] = {}
    for r in peaks:
        stats.setdefault((r["system"], r["workload"], r["repeats"]), {})[r["metric"].rsplit("_", 1)[1]] = r["value"]
    return "\n".join(f"peak goodput of {system} on {workload} over {n} repeats: {v['median']:.2f} req/s median "
                     f"[{v['min']:.2f} / {v['max']:.2f}]" for (system, workload, n), v in stats.items())


def _f(v: float, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def table(levels: list[tuple[dict, Summary]]) -> str:
    """One line per level (system, workload, rate): throughput, goodput, latency percentiles (ms),
    errors by status."""
    header = ["system", "workload", "load", "done", "req/s", "tok/s", "goodput"]
    for key, name in LATENCIES:
        header += [f"{name} p{p}" for p in PERCENTILES]
    header += ["cached", "errors"]
    lines = [header]
    for params, s in levels:
        load = f"{params['rate']:g}/s" if params.get("rate") is not None else f"c={params.get('concurrency')}"
        workload = str(params.get("workload", "")) + (f":{params['class']}" if params.get("class") else "")
        system = str(params.get("system", "")) + (f" #{params['repeat'] + 1}" if "repeat" in params else "")
        cells = [system, workload, load,
                 f"{s.completed}/{s.requests}", _f(s.request_throughput, 2), _f(s.output_throughput, 0),
                 _f(s.goodput, 2) if s.goodput is not None else "-"]
        for key, _ in LATENCIES:
            cells += [_f(s.latency[key][f"p{p}"] * 1e3, 0) for p in PERCENTILES]
        errors = ", ".join(f"{k}:{v}" for k, v in sorted(s.errors.items())) or "0"
        if s.retry_after:
            errors += f" ({s.retry_after} with Retry-After)"
        cells += [f"{s.cached_fraction:.0%}", errors]
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in lines) + \
        "\n(latencies in ms: TTFT to the first token, TPOT per output token after it, ITL between chunks, " \
        "E2EL end to end; goodput: req/s meeting the SLO)"


def plot(levels: list[tuple[dict, Summary]], path: str, slo: Optional[str] = None) -> None:
    """PNG of `figure`."""
    import matplotlib.pyplot as plt

    fig = figure(levels, slo)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(levels: list[tuple[dict, Summary]], slo: Optional[str] = None):
    """TTFT and TPOT p50/p99 and goodput against the offered rate, one colour per system and
    workload (open-loop levels only). The legends sit below the three panels -- the systems' colours,
    then p50 solid and p99 dashed -- so no legend covers a line, however many systems there are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    series: dict[str, list[tuple[float, Summary]]] = {}
    for params, s in levels:
        if params.get("rate") is None:
            continue
        workload = str(params.get("workload", "")) + (f" ({params['class']})" if params.get("class") else "")
        run = f" · run {params['repeat'] + 1}" if "repeat" in params else ""
        series.setdefault(f"{params.get('system', '')} · {workload}{run}", []).append((params["rate"], s))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4))
    handles = []
    for label, points in sorted(series.items()):
        points.sort(key=lambda p: p[0])
        rates = [r for r, _ in points]
        color = None
        for ax, key in ((axes[0], "ttft"), (axes[1], "tpot")):
            line, = ax.plot(rates, [s.latency[key]["p50"] * 1e3 for _, s in points], marker="o", color=color)
            color = line.get_color()
            ax.plot(rates, [s.latency[key]["p99"] * 1e3 for _, s in points], marker="x", linestyle="--", color=color)
        if any(s.goodput is not None for _, s in points):
            axes[2].plot(rates, [s.goodput or 0.0 for _, s in points], marker="o", color=color)
        handles.append(Line2D([], [], color=color, marker="o", label=label))
    axes[0].set_title("TTFT (ms) vs offered rate")
    axes[1].set_title("TPOT (ms) vs offered rate")
    axes[2].set_title(f"goodput (req/s meeting {slo or 'the SLO'})")
    for ax in axes:
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    styles = [Line2D([], [], color="0.3", marker="o", label="p50 (TTFT, TPOT)"),
              Line2D([], [], color="0.3", marker="x", linestyle="--", label="p99 (TTFT, TPOT)")]
    rows = -(-len(handles) // 4) if handles else 1
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.01, 0.0), ncol=min(4, max(1, len(handles))),
               fontsize=9, frameon=False)
    fig.legend(handles=styles, loc="lower right", bbox_to_anchor=(0.99, 0.0), ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.03, 1, 1))
    return fig
