"""Printing benchmark rows as side-by-side tables."""
from __future__ import annotations

from collections import defaultdict


def row(metric: str, value: float, unit: str, **params) -> dict:
    """One benchmark row: distinguishing params, then metric/value/unit."""
    return {**params, "metric": metric, "value": value, "unit": unit}


def pivot(rows: list[dict], column: str, baseline: str | None = None) -> str:
    """A table with one line per (metric, other params) and one column per value of `column`,
    plus `<x>/<baseline>` ratio columns when a baseline is named."""
    cols: list[str] = []
    lines: dict[tuple, dict] = defaultdict(dict)
    units: dict[tuple, str] = {}
    for r in rows:
        key_params = tuple((k, v) for k, v in r.items() if k not in (column, "metric", "value", "unit"))
        key = (r["metric"],) + key_params
        c = str(r[column])
        if c not in cols:
            cols.append(c)
        lines[key][c] = r["value"]
        units[key] = r["unit"]
    ratio_cols = [c for c in cols if baseline and c != baseline]
    header = ["metric", "params", "unit"] + cols + [f"{c}/{baseline}" for c in ratio_cols]
    table = [header]
    for key, vals in lines.items():
        params = " ".join(f"{k}={v}" for k, v in key[1:])
        cells = [key[0], params, units[key]] + [_fmt(vals.get(c)) for c in cols]
        for c in ratio_cols:
            a, b = vals.get(c), vals.get(baseline)
            cells.append(f"{a / b:.2f}x" if a is not None and b else "-")
        table.append(cells)
    widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]
    out = []
    for i, r in enumerate(table):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1e6:
            return f"{v:.3g}"
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)
