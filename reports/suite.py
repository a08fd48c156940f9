"""summary.html: a validation suite at a glance (`kestrel validate`), built from summary.json
alone (kestrel_cli.suite_summary), so a kept summary renders without its traces.

Sections: the median absolute error per headline metric against its target (calibration and
held-out scenarios apart); predicted against measured, one subplot per metric and one point
per scenario; the signed error of every scenario and metric as a heatmap; the deployer's
ladder measured and predicted step by step; the scenarios past 10% with their stage audit.
"""

from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kestrel_sim.validate_spec import HEADLINE, LADDER_PREFIX, TARGETS
from reports import figures, parity
from reports.html import fmt, page

LABELS = dict(HEADLINE)
GROUPS = (("calibration", "calibration", "#72b7b2"), ("held_out", "held out", "#b279a2"))
SIDES = tuple((side, color) for side, color, _ in parity.SIDES)  # parity.html's colors
PARITY_METRICS = ("median_tpot_ms", "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
                  "output_throughput", "p95_e2el_ms")
LADDER_METRICS = ("output_throughput", "p95_e2el_ms", "p95_ttft_ms")
HEATMAP_CLIP_PCT = 50.0
COMPARED = ("pass", "fail")


def compared(doc: dict) -> list[dict]:
    return [e for e in doc["scenarios"] if e["status"] in COMPARED]


def error_of(e: dict, metric: str) -> float | None:
    """The signed error in percent of a compared scenario's metric, None when missing or
    not finite."""
    v = (e.get("errors") or {}).get(metric)
    return v if v is not None and np.isfinite(v) else None


def pct(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.1f}%" if signed else f"{v:.1f}%"


def medians_figure(doc: dict) -> go.Figure | None:
    """Grouped bars: each headline metric's median absolute error, calibration and held
    out; each target a black tick across its metric's bars."""
    medians = doc["median_errors"]
    labels = [label for _, label in HEADLINE]
    fig = go.Figure()
    for group, name, color in GROUPS:
        cells = [medians[group][metric] for metric, _ in HEADLINE]
        if not any(c["median_abs_error_pct"] is not None for c in cells):
            continue
        values = [c["median_abs_error_pct"] for c in cells]
        fig.add_trace(go.Bar(
            name=name, x=labels, y=values, marker_color=color,
            text=[pct(v) for v in values], textposition="auto", textangle=0,
            insidetextanchor="start", cliponaxis=False,
            customdata=[c["scenarios"] for c in cells],
            hovertemplate=f"{name}: %{{y:.1f}}% over %{{customdata}} scenarios<extra></extra>"))
    if not fig.data:
        return None
    targets = doc.get("targets_pct") or TARGETS
    aimed = [(LABELS[m], t) for m, t in targets.items() if m in LABELS]
    fig.add_trace(go.Scatter(
        name="target", x=[a for a, _ in aimed], y=[t for _, t in aimed], mode="markers",
        marker={"symbol": "line-ew-open", "size": 70, "color": "#222", "line": {"width": 3}},
        hovertemplate="target %{y:g}%<extra></extra>"))
    fig.update_layout(barmode="group", yaxis_title="median |error|, %",
                      xaxis={"categoryorder": "array", "categoryarray": labels})
    return figures.styled(fig, "Median absolute error against the targets", height=420)


def medians_html(doc: dict) -> str:
    """The medians as a table; a median past its target in red."""
    targets = doc.get("targets_pct") or TARGETS
    head = "".join(f"<th>{h}</th>" for h in ("metric", "target", "calibration", "held out"))
    body = []
    for metric, label in HEADLINE:
        target = targets.get(metric)
        cells = []
        for group, _, _ in GROUPS:
            cell = doc["median_errors"][group][metric]
            v = cell["median_abs_error_pct"]
            missed = v is not None and target is not None and v > target
            style = " style='color:#c00;font-weight:bold'" if missed else ""
            text = "-" if v is None else f"{v:.1f}% (n={cell['scenarios']})"
            cells.append(f"<td class='num'{style}>{text}</td>")
        body.append(f"<tr><td>{html.escape(label)}</td><td class='num'>"
                    f"{'-' if target is None else f'{target:g}%'}</td>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def log_ticks(lo: float, hi: float) -> dict:
    """Ticks at 1, 2, 5 x 10^n between lo and hi, or at 10^n when that gives too many (on a
    short log axis plotly labels every minor step, which crowds a subplot); plotly's own
    ticks when fewer than three fall in the range."""
    decades = range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
    for steps in ((1, 2, 5), (1,)):
        vals = [d * 10.0 ** n for n in decades for d in steps if lo <= d * 10.0 ** n <= hi]
        if len(vals) <= 9:
            break
    if len(vals) < 3:
        return {}
    return {"tickvals": vals, "ticktext": [short(v) for v in vals]}


def short(v: float) -> str:
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


def parity_figure(doc: dict) -> go.Figure | None:
    """One log-log subplot per headline metric: predicted against measured, one point per
    compared scenario, the y = x line and a +-10% band."""
    entries = compared(doc)
    if not entries:
        return None
    cols = 3
    rows = -(-len(PARITY_METRICS) // cols)
    fig = make_subplots(rows=rows, cols=cols, horizontal_spacing=0.08, vertical_spacing=0.14,
                        subplot_titles=[LABELS[m] for m in PARITY_METRICS])
    for i, metric in enumerate(PARITY_METRICS):
        row, col = i // cols + 1, i % cols + 1
        points = [e for e in entries if (e["measured"].get(metric) or 0) > 0
                  and (e["predicted"].get(metric) or 0) > 0]
        if not points:
            continue
        values = [e[side][metric] for e in points for side in ("measured", "predicted")]
        lo, hi = min(values) / 1.3, max(values) * 1.3
        line = np.geomspace(lo, hi, 40)
        fig.add_trace(go.Scatter(
            x=np.concatenate([line, line[::-1]]), y=np.concatenate([line * 1.1, line[::-1] * 0.9]),
            fill="toself", fillcolor="rgba(0,0,0,0.12)", line={"width": 0}, name="±10%",
            legendgroup="band", showlegend=i == 0, hoverinfo="skip"), row=row, col=col)
        fig.add_trace(go.Scatter(x=line, y=line, mode="lines", name="y = x",
                                 line={"color": "#222", "width": 1}, legendgroup="yx",
                                 showlegend=i == 0, hoverinfo="skip"), row=row, col=col)
        for group, name, color in GROUPS:
            mine = [e for e in points if e["held_out"] == (group == "held_out")]
            if not mine:
                continue
            fig.add_trace(go.Scatter(
                x=[e["measured"][metric] for e in mine], y=[e["predicted"][metric] for e in mine],
                mode="markers", name=name, legendgroup=group, showlegend=i == 0,
                marker={"color": color, "size": 9, "line": {"width": 1, "color": "#fff"}},
                text=[f"{html.escape(e['name'])} ({e['status']})<br>error "
                      f"{pct(error_of(e, metric), signed=True)}" for e in mine],
                hovertemplate="%{text}<br>measured %{x:.4g}<br>predicted %{y:.4g}<extra></extra>"),
                row=row, col=col)
        ticks = {"type": "log", "range": [np.log10(lo), np.log10(hi)], **log_ticks(lo, hi)}
        fig.update_xaxes(ticks, row=row, col=col, title_text="measured" if row == rows else None)
        fig.update_yaxes(ticks, row=row, col=col, title_text="predicted" if col == 1 else None)
    fig.update_layout(legend={"orientation": "h", "y": -0.12})
    return figures.styled(fig, "Predicted against measured, one point per scenario",
                          height=330 * rows + 120)


def row_label(e: dict) -> str:
    if e["status"] not in COMPARED:
        return f"{e['name']} ({e['status']})"
    return f"{e['name']} (held out)" if e["held_out"] else e["name"]


def heatmap_figure(doc: dict) -> go.Figure | None:
    """Scenarios x headline metrics: the signed error in percent, colored on a diverging
    scale clipped at +-50%, the real value as the cell's text; no measurement, no cell."""
    if not compared(doc):
        return None
    entries = doc["scenarios"]
    errors = [[error_of(e, m) if e["status"] in COMPARED else None for m, _ in HEADLINE]
              for e in entries]
    clip = HEATMAP_CLIP_PCT
    z = [[None if v is None else float(np.clip(v, -clip, clip)) for v in row] for row in errors]
    text = [[pct(v, signed=True) if v is not None else "" for v in row] for row in errors]
    hover = [[f"{html.escape(e['name'])}<br>{LABELS[m]}: measured "
              f"{fmt((e.get('measured') or {}).get(m))}, predicted "
              f"{fmt((e.get('predicted') or {}).get(m))}<br>error {pct(v, signed=True)}"
              for (m, _), v in zip(HEADLINE, row)] for e, row in zip(entries, errors)]
    fig = go.Figure(go.Heatmap(
        z=z, x=[label for _, label in HEADLINE], y=[row_label(e) for e in entries],
        zmin=-clip, zmax=clip, zmid=0, colorscale="RdBu_r", hoverongaps=False,
        text=text, texttemplate="%{text}", textfont={"size": 11},
        customdata=hover, hovertemplate="%{customdata}<extra></extra>",
        colorbar={"title": {"text": f"error %<br>(clipped ±{clip:g})"}, "ticksuffix": "%"}))
    fig.update_layout(yaxis={"autorange": "reversed", "type": "category"},
                      xaxis={"side": "top", "type": "category"})
    fig = figures.styled(fig, "", height=max(300, 110 + 26 * len(entries)))
    fig.update_layout(margin={"l": 60, "r": 30, "t": 50, "b": 20})
    return fig


def ladder_figure(doc: dict) -> go.Figure | None:
    """The deployer's ladder in order: measured and predicted side by side per step, for
    output throughput, P95 E2E latency and P95 TTFT."""
    steps = [e for e in doc["scenarios"] if e["name"].startswith(LADDER_PREFIX)]
    if not any((e.get(side) or {}).get(m) is not None
               for e in steps for side, _ in SIDES for m in LADDER_METRICS):
        return None
    names = [e["name"][len(LADDER_PREFIX):] for e in steps]
    fig = make_subplots(rows=1, cols=len(LADDER_METRICS), horizontal_spacing=0.07,
                        subplot_titles=[LABELS[m] for m in LADDER_METRICS])
    for col, metric in enumerate(LADDER_METRICS, start=1):
        for side, color in SIDES:
            values = [(e.get(side) or {}).get(metric) for e in steps]
            if all(v is None for v in values):
                continue
            errs = [pct(error_of(e, metric), signed=True) if e["status"] in COMPARED else
                    e["status"] for e in steps]
            fig.add_trace(go.Bar(
                x=names, y=values, name=side, marker_color=color, legendgroup=side,
                showlegend=col == 1, customdata=errs,
                hovertemplate=f"%{{x}}<br>{side} %{{y:.4g}}<br>error %{{customdata}}"
                              "<extra></extra>"), row=1, col=col)
        fig.update_xaxes(tickangle=-30, row=1, col=col)
    fig.update_layout(barmode="group")
    fig = figures.styled(fig, "Each step measured and predicted", height=490)
    fig.update_layout(margin={"t": 90})
    return fig


def explain_html(doc: dict) -> str | None:
    """The scenarios past the explain threshold: their metrics past it and the measured
    stages the costs price furthest off."""
    if not compared(doc):
        return None
    past = doc.get("explain_past_pct", 10.0)
    by_name = {e["name"]: e for e in doc["scenarios"]}
    if not doc["to_explain"]:
        return f"<p>No scenario is past {past:g}% on a headline metric.</p>"
    items = []
    for name in doc["to_explain"]:
        e = by_name[name]
        off = ", ".join(f"{LABELS[m]} {pct(v, signed=True)}" for m, _ in HEADLINE
                        if m != "duration" and (v := error_of(e, m)) is not None
                        and abs(v) > past)
        group = "held out" if e["held_out"] else "calibration"
        gaps = "".join(f"<li>{html.escape(g)}</li>" for g in e.get("gaps") or [])
        note = f"<br><i>{html.escape(e['note'])}</i>" if e.get("note") else ""
        items.append(f"<li><b>{html.escape(name)}</b> ({group}): {html.escape(off)}{note}"
                     + (f"<ul>{gaps}</ul>" if gaps else "") + "</li>")
    return (f"<p>Scenarios past {past:g}% on a headline metric, with the measured stages "
            "whose time the simulator's costs price furthest off (each stage priced at the "
            "shapes it ran; kestrel_sim/stage_audit.py):</p><ul>" + "".join(items) + "</ul>")


def overview_html(doc: dict) -> str:
    entries = doc["scenarios"]
    counts: dict[str, int] = {}
    for e in entries:
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    held = sum(1 for e in compared(doc) if e["held_out"])
    text = (f"<p>{len(entries)} scenarios: "
            + ", ".join(f"{n} {html.escape(s)}" for s, n in counts.items()) + ". ")
    if compared(doc):
        text += (f"{len(compared(doc))} compared with a measurement ({held} held out of "
                 "calibration). Errors are (predicted − measured) / measured; "
                 "hover a point or a cell for its scenario and values.</p>")
    else:
        text += ("None compared with a measurement (run with <code>--on both</code>, or "
                 "<code>--measured</code>): only the predictions are shown.</p>")
    return text


def suite_report(doc: dict, title: str) -> str:
    """summary.html as one self-contained HTML string, from a summary.json document."""
    medians = medians_figure(doc)
    sections: list[tuple[str, object]] = [
        ("Suite", overview_html(doc)),
        ("Medians against targets", medians),
        ("Medians, table", medians_html(doc) if medians is not None else None),
        ("Predicted against measured", parity_figure(doc)),
        ("Error per scenario and metric", heatmap_figure(doc)),
        ("The deployer's ladder", ladder_figure(doc)),
        ("To be explained", explain_html(doc)),
    ]
    return page(title, sections)
