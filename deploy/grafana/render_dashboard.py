"""Draws the dashboard's latency panels (time to first token and inter-token latency, p50/p95/p99
per model) from a running Prometheus into one PNG: for the docs, and where no Grafana runs.

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
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "serving.json"
PANELS = ("Time to first token", "Inter-token latency")
Series = tuple[list[datetime], list[float]]


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


def panel_series(prometheus: str, dashboard: Path, title: str, start: float, end: float, step_s: float) -> dict[str, dict[str, Series]]:
    """model -> line label (e.g. "p99") -> (times, milliseconds); NaN (no traffic in the window) stays a gap."""
    by_model: dict[str, dict[str, Series]] = {}
    for target in panel_targets(dashboard, title):
        for result in query_range(prometheus, target["expr"], start, end, step_s):
            model = result["metric"].get("model", "")
            label = legend(target.get("legendFormat", ""), result["metric"]).removeprefix(model).strip() or target["expr"]
            times = [datetime.fromtimestamp(float(t)) for t, _ in result["values"]]
            values = [float(v) * 1000.0 for _, v in result["values"]]
            by_model.setdefault(model, {})[label] = (times, values)
    return by_model


def render(prometheus: str, dashboard: Path, out: Path, minutes: float) -> int:
    """Writes the PNG; returns the number of lines drawn (0: Prometheus has no latency data in the window)."""
    end = time.time()
    start = end - minutes * 60
    step_s = max(1.0, minutes * 60 / 400)
    data = {title: panel_series(prometheus, dashboard, title, start, end, step_s) for title in PANELS}
    models = sorted({model for panel in data.values() for model in panel})
    if not models:
        return 0
    figure, axes = plt.subplots(len(PANELS), len(models), figsize=(6.5 * len(models), 3.6 * len(PANELS)), squeeze=False, sharex=True)
    drawn = 0
    for row, title in enumerate(PANELS):
        for col, model in enumerate(models):
            ax = axes[row][col]
            for label, (times, values) in sorted(data[title].get(model, {}).items()):
                if any(not math.isnan(v) for v in values):
                    ax.plot(times, values, label=label, linewidth=1.2)
                    drawn += 1
            ax.set_title(f"{title}: {model}", fontsize=10)
            ax.set_ylabel("ms")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(mdates.MinuteLocator(interval=max(1, round(minutes / 6))))
            ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
            if ax.has_data():
                ax.legend(fontsize=8, loc="best")
    figure.suptitle(f"Serving latency over the last {minutes:g} min (quantiles of 1 min rates; {prometheus})", fontsize=11)
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
        sys.exit(f"no latency data in Prometheus at {args.prometheus} over the last {args.minutes:g} min; nothing written")
    print(f"wrote {args.out} ({drawn} lines)")


if __name__ == "__main__":
    main()
