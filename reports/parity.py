"""parity.html: one scenario measured on the runtime and predicted by the simulator, side
by side (`kestrel run --on both`). Self-contained: plotly.js embedded once.

Sections: the verdict and the metric table (kestrel_sim.comparison rows), predicted against
measured per metric on log axes with the y = x line and the tolerance band, the error of
each checked metric against its tolerance, per-request TTFT / TPOT / E2E latency CDFs
overlaid, stage-time shares side by side, and both timelines.
"""

from __future__ import annotations

import html
import json

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kestrel_sim.comparison import Row, per_request_ms
from kestrel_sim.metrics import Metrics
from kestrel_sim.trace import Trace
from kestrel_sim.validate_spec import CHECKABLE
from reports import figures
from reports.html import fmt, page

SIDES = (("measured", "#4c78a8", "solid"), ("predicted", "#f58518", "dash"))
STATUS_COLORS = {"pass": "#54a24b", "fail": "#e45756", "info": "#9d9d9d"}
TIMELINE_SPANS = 400  # per side: keeps the page small


def parity_figure(rows: list[Row]) -> go.Figure | None:
    """Predicted against measured, one point per checkable metric with both values
    positive; log axes, the y = x line and a band of +-10%."""
    points = [r for r in rows if r.metric in CHECKABLE and r.status in STATUS_COLORS
              and r.measured and r.predicted and r.measured > 0 and r.predicted > 0]
    if not points:
        return None
    values = [v for r in points for v in (r.measured, r.predicted)]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    fig = go.Figure()
    line = np.geomspace(lo, hi, 50)
    fig.add_trace(go.Scatter(x=line, y=line, mode="lines", name="y = x",
                             line={"color": "#222", "width": 1}))
    for factor, label in ((1.1, "+10%"), (0.9, "-10%")):
        fig.add_trace(go.Scatter(x=line, y=line * factor, mode="lines", name=label,
                                 line={"color": "#999", "width": 1, "dash": "dot"},
                                 showlegend=label == "+10%", legendgroup="band"))
    for status, color in STATUS_COLORS.items():
        group = [r for r in points if r.status == status]
        if not group:
            continue
        label = {"pass": "checked, within tolerance", "fail": "checked, past tolerance",
                 "info": "not checked"}[status]
        fig.add_trace(go.Scatter(
            x=[r.measured for r in group], y=[r.predicted for r in group], mode="markers",
            name=label, marker={"color": color, "size": 10 if status != "info" else 7},
            text=[f"{r.metric} ({r.unit})<br>error {r.error_pct:+.1f}%" for r in group],
            hovertemplate="%{text}<br>measured %{x:.4g}<br>predicted %{y:.4g}<extra></extra>"))
    fig.update_layout(xaxis={"type": "log", "title": "measured"},
                      yaxis={"type": "log", "title": "predicted", "scaleanchor": "x"})
    return figures.styled(fig, "Predicted against measured (each metric in its own unit)",
                           height=560)


def error_figure(rows: list[Row]) -> go.Figure | None:
    """Error of every checkable metric with a finite error, checked ones with their
    tolerance."""
    shown = [r for r in rows if r.metric in CHECKABLE and r.error_pct is not None
             and np.isfinite(r.error_pct) and r.status in STATUS_COLORS]
    if not shown:
        return None
    fig = go.Figure(go.Bar(
        y=[r.metric for r in shown], x=[r.error_pct for r in shown], orientation="h",
        marker_color=[STATUS_COLORS[r.status] for r in shown],
        hovertemplate="%{y}: %{x:+.1f}%<extra></extra>", name="error"))
    checked = [r for r in shown if r.tolerance_pct is not None]
    for sign in (1, -1):
        fig.add_trace(go.Scatter(
            y=[r.metric for r in checked], x=[sign * r.tolerance_pct for r in checked],
            mode="markers", marker={"symbol": "line-ns-open", "size": 16, "color": "#222"},
            name="tolerance", showlegend=sign == 1,
            hovertemplate="tolerance %{x:+.1f}%<extra></extra>"))
    fig.update_layout(xaxis_title="(predicted - measured) / measured, %",
                      yaxis={"autorange": "reversed"})
    return figures.styled(fig, "Error per metric", height=max(320, 90 + 22 * len(shown)))


def cdf_figure(measured: Metrics, predicted: Metrics) -> go.Figure:
    """Per-request TTFT, TPOT and E2E latency CDFs, measured and predicted overlaid."""
    names = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in names])
    for (side, color, dash), m in zip(SIDES, (measured, predicted)):
        arrays = per_request_ms(m)
        for col, (key, _) in enumerate(names, start=1):
            values = arrays[key]
            if values.size:
                x, y = figures.cdf_points(values)
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=side, legendgroup=side,
                                         showlegend=col == 1,
                                         line={"color": color, "dash": dash}), row=1, col=col)
            fig.update_xaxes(title_text="ms", row=1, col=col)
    fig.update_yaxes(title_text="fraction of requests", row=1, col=1)
    return figures.styled(fig, "Per-request latency CDFs", height=400)


def stage_share_figure(measured: Metrics, predicted: Metrics) -> go.Figure | None:
    """Each stage's share of busy time, measured and predicted side by side."""
    kinds = [k for k in figures.KIND_COLORS
             if k in measured.stage_share or k in predicted.stage_share]
    if not kinds:
        return None
    fig = go.Figure()
    for (side, color, _), m in zip(SIDES, (measured, predicted)):
        fig.add_trace(go.Bar(name=side, x=kinds, marker_color=color,
                             y=[100 * m.stage_share.get(k, 0.0) for k in kinds],
                             hovertemplate=f"{side} %{{x}}: %{{y:.1f}}%<extra></extra>"))
    fig.update_layout(barmode="group", yaxis_title="% of busy time")
    return figures.styled(fig, "Where the time goes", height=380)


def rows_html(rows: list[Row]) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("metric", "unit", "measured", "predicted",
                                             "error %", "tolerance %", "status", "note"))
    body = []
    for r in rows:
        err = "-" if r.error_pct is None else (
            f"{r.error_pct:+.1f}" if np.isfinite(r.error_pct) else "inf")
        color = {"fail": " style='color:#c00;font-weight:bold'"}.get(r.status, "")
        cells = [html.escape(r.metric), html.escape(r.unit), fmt(r.measured),
                 fmt(r.predicted), err, fmt(r.tolerance_pct)]
        body.append("<tr>" + "".join(f"<td class='num'>{c}</td>" if i > 1 else f"<td>{c}</td>"
                                     for i, c in enumerate(cells))
                    + f"<td{color}>{r.status}</td><td>{html.escape(r.note)}</td></tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def verdict_html(rows: list[Row], measured_trace: Trace, predicted_trace: Trace) -> str:
    failed = [r for r in rows if r.status == "fail"]
    checked = [r for r in rows if r.status in ("pass", "fail")]
    if failed:
        text = (f"<p style='color:#c00'><b>{len(failed)} of {len(checked)} checked metrics "
                "past tolerance:</b> " + ", ".join(
                    f"{html.escape(r.metric)} ({r.error_pct:+.1f}%)" for r in failed) + "</p>")
    else:
        text = f"<p><b>All {len(checked)} checked metrics within tolerance.</b></p>"
    about = [("measured on", measured_trace.meta.get("device")),
             ("measured backend", measured_trace.meta.get("backend")),
             ("acceptance", "controlled (drawn from spec.acceptance)"
              if measured_trace.meta.get("acceptance_controlled") else None),
             ("predicted with", predicted_trace.meta.get("costs")),
             ("calibrated", predicted_trace.meta.get("calibrated"))]
    items = "".join(f"<li>{k}: {html.escape(str(v))}</li>" for k, v in about if v is not None)
    return text + f"<ul>{items}</ul>"


def audit_html(audit: list[dict] | None) -> str | None:
    """The measured stages priced at their shapes (kestrel_sim.stage_audit): per stage in
    all, then per batch."""
    if not audit:
        return None
    from kestrel_sim.stage_audit import totals

    def err(v):
        return "-" if v is None else f"{v:+.1f}"

    def table(head, lines):
        th = "".join(f"<th>{h}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td class='num'>{c}</td>" if i > 1 else f"<td>{c}</td>"
                                        for i, c in enumerate(cells)) + "</tr>"
                       for cells in lines)
        return f"<table><tr>{th}</tr>{body}</table>"

    overall = table(("worker", "stage", "spans", "measured s", "priced s", "error %"),
                    [(t["worker"], html.escape(t["stage"]), t["spans"], f"{t['measured_s']:.3f}",
                      f"{t['priced_s']:.3f}", err(t["error_pct"])) for t in totals(audit)])
    each = table(("worker", "stage", "batch", "tokens / seq", "spans", "measured ms",
                  "priced ms", "error %"),
                 [(r["worker"], html.escape(r["stage"]), r["batch"], f"{r['tokens_per_seq']:g}",
                   r["spans"], f"{r['measured_ms']:.3f}", f"{r['priced_ms']:.3f}",
                   err(r["error_pct"])) for r in audit])
    return ("<p>Each measured step priced by the simulator's costs at the shape it ran "
            "(negative: priced too fast). Time between steps (the host's) is not in it.</p>"
            "<p>Per stage, in all:</p>" + overall + "<p>Per batch and tokens per sequence "
            "(a mean context each):</p>" + each)


def traced_html(traced: dict | None) -> str | None:
    """Each worker's share of its working time its steps cover, both sides."""
    if not traced:
        return None

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    th = "".join(f"<th>{h}</th>" for h in ("worker", "measured", "predicted"))
    body = "".join(f"<tr><td>{html.escape(w)}</td><td class='num'>{pct(t['measured'])}</td>"
                   f"<td class='num'>{pct(t['predicted'])}</td></tr>" for w, t in traced.items())
    return ("<p>The share of each worker's working time (from a request's prefill, or decode, "
            "to its finish) its steps cover; the rest is time between steps: the host's, "
            "which the simulator prices as each round's overhead.</p>"
            f"<table><tr>{th}</tr>{body}</table>")


def parity_report(name: str, rows: list[Row], measured: Metrics, predicted: Metrics,
                  measured_trace: Trace, predicted_trace: Trace,
                  scenario: dict | None = None, audit: list[dict] | None = None,
                  traced: dict | None = None) -> str:
    """The whole page as one HTML string."""
    timelines = []
    for side, trace in (("measured", measured_trace), ("predicted", predicted_trace)):
        if trace.spans:
            fig = figures.timeline_figure(trace, max_spans=TIMELINE_SPANS)
            fig.update_layout(title=f"{side}: {fig.layout.title.text}")
            timelines.append((f"Timeline, {side}", fig))
    sections = [
        ("Verdict", verdict_html(rows, measured_trace, predicted_trace)),
        ("Predicted against measured", parity_figure(rows)),
        ("Error per metric", error_figure(rows)),
        ("Latency CDFs", cdf_figure(measured, predicted)),
        ("Stage shares", stage_share_figure(measured, predicted)),
        ("Measured stages, priced at their shapes", audit_html(audit)),
        ("Time between steps", traced_html(traced)),
        *timelines,
        ("Metrics", rows_html(rows)),
    ]
    if scenario is not None:
        text = html.escape(json.dumps(scenario, indent=2, default=str))
        sections.append(("Scenario", f"<pre>{text}</pre>"))
    return page(f"Kestrel parity: {name}", sections)
