"""Self-contained HTML reports: plotly.js embedded once, so a report opens offline."""

from __future__ import annotations

import html
import json

import plotly.graph_objects as go

from kestrel_sim.metrics import Metrics
from kestrel_sim.timeseries import TimeSeries
from kestrel_sim.trace import Trace
from reports import figures

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { padding: 3px 12px; border-bottom: 1px solid #ddd; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
"""


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def table_html(rows: list[tuple[str, object]]) -> str:
    body = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td class='num'>{html.escape(_fmt(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table>{body}</table>"


def metric_rows(metrics: Metrics) -> list[tuple[str, object]]:
    """(name, value) rows of a Metrics, flattening lists and dicts."""
    rows: list[tuple[str, object]] = []
    for name, value in metrics.model_dump().items():
        if isinstance(value, dict):
            rows += [(f"{name}[{k}]", v) for k, v in value.items()]
        elif isinstance(value, list):
            rows += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        else:
            rows.append((name, value))
    return rows


def page(title: str, sections: list[tuple[str, object]]) -> str:
    """An HTML page; a section's body is a plotly Figure or an HTML string."""
    parts = [(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title><style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>")]
    plotly_included = False
    for heading, body in sections:
        if body is None:
            continue
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if isinstance(body, go.Figure):
            parts.append(body.to_html(full_html=False, include_plotlyjs=not plotly_included,
                                      config={"displaylogo": False}))
            plotly_included = True
        else:
            parts.append(body)
    parts.append("</body></html>")
    return "\n".join(parts)


def run_report(trace: Trace, metrics: Metrics, timeseries: TimeSeries,
               scenario: dict | None = None) -> str:
    """report.html of one run: metrics, timeline, CDFs, time series, acceptance."""
    name = trace.meta.get("name") or (scenario or {}).get("name") or "run"
    about = [(k, v) for k, v in trace.meta.items()
             if isinstance(v, (str, int, float, bool)) and len(str(v)) <= 80]
    sections: list[tuple[str, object]] = [
        ("Run", table_html(about) if about else None),
        ("Metrics", table_html(metric_rows(metrics))),
        ("Stage timeline", figures.timeline_figure(trace)),
        ("Stage time", figures.stage_time_figure(trace)),
        ("Latency", figures.latency_cdf_figure(trace)),
        ("Over time", figures.timeseries_figure(timeseries)),
        ("Speculative decoding", figures.acceptance_figure(trace)),
    ]
    if scenario is not None:
        text = html.escape(json.dumps(scenario, indent=2, default=str))
        sections.append(("Scenario", f"<pre>{text}</pre>"))
    return page(f"Kestrel run: {name}", sections)


def sweep_report(name: str, rows: list[dict], axes: list[str]) -> str:
    """sweep.html: curves against the first axis, heatmaps when there are exactly two axes."""
    sections: list[tuple[str, object]] = [("Curves", figures.sweep_curves_figure(rows, axes))]
    if len(axes) == 2:
        for metric in ("output_throughput", "request_goodput", "p99_ttft_ms", "mean_tpot_ms"):
            if any(r["metrics"].get(metric) is not None for r in rows):
                sections.append((metric, figures.sweep_heatmap_figure(rows, *axes, metric)))
    header = ["#", *axes, "output_throughput", "request_throughput", "mean_ttft_ms",
              "mean_tpot_ms", "request_goodput"]
    body = "".join(
        "<tr>" + f"<td>{i}</td>"
        + "".join(f"<td class='num'>{html.escape(_fmt(r['params'][a]))}</td>" for a in axes)
        + "".join(f"<td class='num'>{_fmt(r['metrics'].get(m))}</td>" for m in header[1 + len(axes):])
        + "</tr>"
        for i, r in enumerate(rows)
    )
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    sections.append(("Table", f"<table><tr>{head}</tr>{body}</table>"))
    return page(f"Kestrel sweep: {name}", sections)
