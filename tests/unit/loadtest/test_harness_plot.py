"""The load harness's plot: every system gets one colour across the three panels, and the legends
sit below the panels, so no legend covers a line however many systems a comparison has."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from kvmesh.loadtest.harness.report import figure  # noqa: E402
from kvmesh.loadtest.harness.stats import Summary  # noqa: E402


def _level(system: str, rate: float, scale: float) -> tuple[dict, Summary]:
    lat = {k: {"mean": scale * rate, "p50": scale * rate, "p90": 2 * scale * rate, "p99": 3 * scale * rate}
           for k in ("ttft", "tpot", "itl", "e2el")}
    return ({"system": system, "workload": "rag", "rate": rate},
            Summary(requests=8, completed=8, duration_s=8 / rate, input_tokens=800, output_tokens=256,
                    cached_tokens=0, errors={}, latency=lat, goodput=rate / scale, slo="ttft=2s"))


@pytest.mark.parametrize("systems", [1, 3, 6])
def test_legends_are_below_the_panels_and_colours_match_across_them(systems):
    import matplotlib.pyplot as plt

    names = [f"system{i}" for i in range(systems)]
    levels = [_level(n, r, 1 + i) for i, n in enumerate(names) for r in (0.5, 1.0, 2.0)]
    fig = figure(levels, "ttft=2s")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert all(ax.get_legend() is None for ax in fig.axes)
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert labels == [f"{n} · rag" for n in names]
        lowest_axes = min(ax.get_tightbbox(renderer).y0 for ax in fig.axes)  # tick labels included
        for legend in fig.legends:
            assert legend.get_window_extent(renderer).y1 <= lowest_axes
        # one colour per system in each panel: TTFT and TPOT draw p50 and p99, goodput one line
        colours = [[line.get_color() for line in ax.get_lines()] for ax in fig.axes]
        assert colours[0] == colours[1] == [c for c in colours[2] for _ in range(2)]
        assert len(set(colours[2])) == systems
    finally:
        plt.close(fig)
