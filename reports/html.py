"""Self-contained HTML reports: plotly.js embedded once, so a report opens offline."""

from __future__ import annotations

import html
import json

import plotly.graph_objects as go

from kestrel_sim.metrics import PER_REQUEST_ARRAYS, Metrics
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


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def table_html(rows: list[tuple[str, object]]) -> str:
    body = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td class='num'>{html.escape(fmt(v))}</td></tr>"
        for k, v in rows
    )
    return f"<table>{body}</table>"


def metric_rows(metrics: Metrics) -> list[tuple[str, object]]:
    """(name, value) rows of a Metrics, flattening lists and dicts; the per-request arrays
    (metrics.json has them) are left out."""
    rows: list[tuple[str, object]] = []

    def add(name: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{name}[{k}]", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                add(f"{name}[{i}]", v)
        else:
            rows.append((name, value))

    for name, value in metrics.model_dump(exclude=set(PER_REQUEST_ARRAYS)).items():
        add(name, value)
    return rows


def about_run(meta: dict) -> str:
    """Notes on where the numbers come from: uncalibrated costs, a trace kept in part."""
    notes = []
    if meta.get("costs") == "roofline":
        notes.append(
            "<b>Uncalibrated.</b> Stage times come from the analytic roofline (bytes over "
            "bandwidth, flops over peak), not from a profile measured on this hardware; "
            "measured stage times are usually longer. Give <code>costs: {profile: ...}</code> "
            "for calibrated numbers.")
    kept = meta.get("trace")
    if isinstance(kept, dict) and kept.get("mode") != "full":
        if kept.get("mode") == "none":
            what = "no spans and no requests (run with the trace kept to see them)"
        elif kept.get("complete"):
            what = f"all {kept['spans_seen']:,} spans (a sample keeps all up to " \
                   f"{kept['sample_budget_spans']:,})"
        else:
            what = (f"a sample: {kept['spans_kept']:,} of {kept['spans_seen']:,} spans, those "
                    f"starting in {kept['window_s']:g} s windows every "
                    f"{kept['windows_every_s']:g} s, and the requests arriving in them")
        notes.append(f"<b>Trace.</b> trace.json and the timeline hold {what}. Metrics and "
                     "time series count every request and span of the run.")
    return "".join(f"<p>{n}</p>" for n in notes)


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
    notes = about_run(trace.meta)
    sections: list[tuple[str, object]] = [
        ("Run", (notes + (table_html(about) if about else "")) or None),
        ("Metrics", table_html(metric_rows(metrics))),
        ("Stage timeline", figures.timeline_figure(trace) if trace.spans else None),
        ("Stage time", figures.stage_time_figure(metrics)),
        ("Latency", figures.latency_cdf_figure(metrics)),
        ("Over time", figures.timeseries_figure(timeseries)),
        ("Speculative decoding", figures.acceptance_figure(metrics)),
    ]
    if scenario is not None:
        text = html.escape(json.dumps(scenario, indent=2, default=str))
        sections.append(("Scenario", f"<pre>{text}</pre>"))
    uncalibrated = " (uncalibrated roofline)" if trace.meta.get("costs") == "roofline" else ""
    return page(f"Kestrel run: {name}{uncalibrated}", sections)


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
        + "".join(f"<td class='num'>{html.escape(fmt(r['params'][a]))}</td>" for a in axes)
        + "".join(f"<td class='num'>{fmt(r['metrics'].get(m))}</td>" for m in header[1 + len(axes):])
        + "</tr>"
        for i, r in enumerate(rows)
    )
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    sections.append(("Table", f"<table><tr>{head}</tr>{body}</table>"))
    return page(f"Kestrel sweep: {name}", sections)
