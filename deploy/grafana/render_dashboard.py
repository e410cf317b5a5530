"""Draws dashboard panels from a running Prometheus into one PNG: the latency panels (time to
first token and inter-token latency, p50/p95/p99 per model) and the replicas over time (one band per
replica, stacked, per model deployment). For the docs, and where no Grafana runs.

    .venv/bin/python deploy/grafana/render_dashboard.py --prometheus http://127.0.0.1:9090 --out docs/dashboard.png

The queries are the panels' own (deploy/grafana/dashboards/serving.json), evaluated over the last
--minutes with Prometheus's query_range API.
"""

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "serving.json"
Series = tuple[list[datetime], list[float]]


@dataclass(frozen=True)
class PanelStyle:
    by: str  # the label whose values get a plot each (a column)
    scale: float  # values are multiplied by this
    unit: str
    stacked: bool = False  # the first target's series are stacked bands; the others stay lines


PANELS = {
    "Time to first token": PanelStyle("model", 1000.0, "ms"),
    "Inter-token latency": PanelStyle("model", 1000.0, "ms"),
    "Replicas over time": PanelStyle("deployment", 1.0, "replicas", stacked=True),
}


def panel_targets(dashboard: Path, title: str) -> list[dict[str, str]]:
    """The targets (expr, legendFormat) of the panel with this title; KeyError if there is none."""
    for panel in json.loads(dashboard.read_text())["panels"]:
        if panel["title"] == title:
            return list(panel["targets"])
    raise KeyError(f"no panel {title!r} in {dashboard}")


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
    """The matrix `expr` evaluates to over [start, end]; raises RuntimeError unless Prometheus says success."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": f"{step_s:g}s"})
    with urllib.request.urlopen(f"{prometheus.rstrip('/')}/api/v1/query_range?{params}", timeout=60) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return list(body["data"]["result"])


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' value of that label."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def panel_series(
    prometheus: str, dashboard: Path, title: str, style: PanelStyle, start: float, end: float, step_s: float
) -> dict[str, dict[tuple[int, str], Series]]:
    """value of style.by (e.g. a model) -> (target index, line label, e.g. "p99") -> (times, values
    x style.scale) on one grid of times; NaN (no sample at a time) stays a gap."""
    grid = [start + i * step_s for i in range(int((end - start) / step_s) + 1)]
    times = [datetime.fromtimestamp(t) for t in grid]
    by_group: dict[str, dict[tuple[int, str], Series]] = {}
    for index, target in enumerate(panel_targets(dashboard, title)):
        for result in query_range(prometheus, target["expr"], start, end, step_s):
            group = result["metric"].get(style.by, "")
            label = legend(target.get("legendFormat", ""), result["metric"]).removeprefix(group).strip() or target["expr"]
            samples = {round((float(t) - start) / step_s): float(v) * style.scale for t, v in result["values"]}
            values = [samples.get(i, math.nan) for i in range(len(grid))]
            by_group.setdefault(group, {})[(index, label)] = (times, values)
    return by_group


def draw(ax: Any, style: PanelStyle, series: dict[tuple[int, str], Series]) -> int:
    """Draws one plot of a panel; returns the number of series drawn."""
    drawn = 0
    if style.stacked:
        bands = [values for (index, _), (_, values) in sorted(series.items()) if index == 0]
        if bands:
            times = next(iter(series.values()))[0]
            ax.stackplot(times, [[0.0 if math.isnan(v) else v for v in band] for band in bands], step="post", alpha=0.5, linewidth=0.5)
            ax.plot([], [], alpha=0, label=f"one band per replica ({len(bands)} replicas in the window)")
            drawn += len(bands)
    for (index, label), (times, values) in sorted(series.items()):
        if (index > 0 or not style.stacked) and any(not math.isnan(v) for v in values):
            ax.plot(times, values, label=label, linewidth=1.2, drawstyle="steps-post" if style.stacked else "default")
            drawn += 1
    return drawn


def render(prometheus: str, dashboard: Path, out: Path, minutes: float) -> int:
    """Writes the PNG; returns the number of series drawn (0: Prometheus has no data for the panels in the window)."""
    end = time.time()
    start = end - minutes * 60
    step_s = max(1.0, minutes * 60 / 400)
    data = {title: panel_series(prometheus, dashboard, title, style, start, end, step_s) for title, style in PANELS.items()}
    titles = [title for title in PANELS if data[title]]
    if not titles:
        return 0
    columns = max(len(data[title]) for title in titles)
    figure, axes = plt.subplots(len(titles), columns, figsize=(6.5 * columns, 3.6 * len(titles)), squeeze=False, sharex=True)
    drawn = 0
    for row, title in enumerate(titles):
        style = PANELS[title]
        for col in range(columns):
            ax = axes[row][col]
            groups = sorted(data[title])
            if col >= len(groups):
                ax.set_visible(False)
                continue
            drawn += draw(ax, style, data[title][groups[col]])
            ax.set_title(f"{title}: {groups[col]}", fontsize=10)
            ax.set_ylabel(style.unit)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=8))
            ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M" if minutes >= 5 else "%H:%M:%S"))
            if ax.has_data():
                ax.legend(fontsize=8, loc="best")
    figure.suptitle(f"Serving over the last {minutes:g} min (latency: quantiles of 1 min rates; {prometheus})", fontsize=11)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return drawn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--minutes", type=float, default=15.0, help="how far back to draw")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD, help="the Grafana dashboard whose queries to draw")
    args = parser.parse_args(argv)
    try:
        drawn = render(args.prometheus, args.dashboard, args.out, args.minutes)
    except (urllib.error.URLError, RuntimeError) as error:
        sys.exit(f"querying Prometheus at {args.prometheus} failed: {error}")
    if drawn == 0:
        sys.exit(f"no data for the panels in Prometheus at {args.prometheus} over the last {args.minutes:g} min; nothing written")
    print(f"wrote {args.out} ({drawn} lines)")


if __name__ == "__main__":
    main()
