"""Plotly figures of one run (from a Trace) and of a sweep (from a table of results)."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kestrel_sim.metrics import Metrics
from kestrel_sim.timeseries import TimeSeries
from kestrel_sim.trace import Trace

KIND_COLORS = {
    "prefill": "#4c78a8", "draft": "#f58518", "verify": "#54a24b", "correction": "#e45756",
    "decode": "#72b7b2", "kv_transfer": "#b279a2", "queue_wait": "#bab0ac",
}
CDF_POINTS = 500  # quantiles drawn per CDF (keeps the HTML small at any request count)


def styled(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(title=title, height=height, template="plotly_white",
                      margin={"l": 60, "r": 30, "t": 60, "b": 50})
    return fig


def timeline_window(trace: Trace, max_spans: int = 1000) -> tuple[float, float]:
    """A window in the middle of the run holding at most `max_spans` worker spans (within
    one of the windows a sampled trace kept, so the chart has no hole)."""
    starts = np.sort([s.start for s in trace.spans if s.kind != "queue_wait"])
    if starts.size == 0:
        return 0.0, 0.0
    kept = trace.meta.get("trace") if isinstance(trace.meta, dict) else None
    if isinstance(kept, dict) and not kept.get("complete", True) and kept.get("window_s"):
        window = kept["window_s"]
        slots = np.floor_divide(starts, window)
        middle = slots[starts.size // 2]
        starts = starts[slots == middle]
        if starts.size <= max_spans:
            return float(starts[0]), float((middle + 1) * window)
    else:
        if starts.size <= max_spans:
            return float(starts[0]), float(max(s.end for s in trace.spans))
    first = (starts.size - max_spans) // 2
    return float(starts[first]), float(starts[first + max_spans - 1])


def timeline_figure(trace: Trace, window: tuple[float, float] | None = None,
                    max_spans: int = 1000) -> go.Figure:
    """Gantt chart: one row per worker, one bar per span, coloured by stage. A prefill
    chunk that rides in a decode/verify forward (same worker, start and end) is drawn as
    a thinner bar on top of it."""
    lo, hi = window or timeline_window(trace, max_spans)
    spans = [s for s in trace.spans
             if s.kind != "queue_wait" and s.start >= lo and s.start <= hi]
    workers = sorted({s.worker for s in spans})
    steps = {(s.worker, s.start, s.end) for s in spans if s.kind in ("decode", "verify")}

    def rides(s) -> bool:  # a prefill chunk carried by a decode/verify forward
        return s.kind == "prefill" and (s.worker, s.start, s.end) in steps

    fig = go.Figure()
    groups = [(kind, color, [s for s in spans if s.kind == kind and not rides(s)], None)
              for kind, color in KIND_COLORS.items()]
    groups.append(("prefill in decode/verify", KIND_COLORS["prefill"],
                   [s for s in spans if rides(s)], 0.3))
    for kind, color, group, width in groups:
        if not group:
            continue
        fig.add_trace(go.Bar(
            name=kind, orientation="h", marker_color=color, width=width,
            base=[s.start for s in group], x=[s.end - s.start for s in group],
            y=[s.worker for s in group],
            customdata=[[len(s.requests), s.tokens, (s.end - s.start) * 1e3,
                         sum(s.accepted) if s.accepted else 0] for s in group],
            hovertemplate=(f"{kind}<br>start %{{base:.4f}} s<br>%{{customdata[2]:.3f}} ms"
                           "<br>batch %{customdata[0]}<br>tokens %{customdata[1]}"
                           + ("<br>accepted %{customdata[3]}" if kind == "verify" else "")
                           + "<extra></extra>"),
        ))
    fig.update_layout(barmode="overlay", bargap=0.3, xaxis_title="time (s)",
                      yaxis={"categoryorder": "array", "categoryarray": workers[::-1]})
    return styled(fig, f"Stage timeline, {lo:.3f}-{hi:.3f} s ({len(spans)} spans)",
                   height=max(300, 120 + 50 * len(workers)))


def cdf_points(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = np.linspace(0.0, 1.0, min(CDF_POINTS, max(values.size, 2)))
    return np.quantile(values, q), q


def latency_cdf_figure(metrics: Metrics) -> go.Figure:
    """CDFs of TTFT, TPOT and end-to-end latency over completed requests (from the metrics'
    per-request arrays)."""
    out = np.asarray(metrics.output_lens, dtype=float)
    done = out > 0
    ttft = np.asarray(metrics.ttfts)[done] * 1e3
    e2el = np.asarray(metrics.latencies)[done] * 1e3
    multi = out[done] > 1
    tpot = (e2el[multi] - ttft[multi]) / (out[done][multi] - 1)
    names = [("TTFT", ttft), ("TPOT", tpot), ("E2E latency", e2el)]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[n for n, _ in names])
    for col, (name, values) in enumerate(names, start=1):
        if values.size:
            x, y = cdf_points(values)
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name, showlegend=False),
                          row=1, col=col)
        fig.update_xaxes(title_text="ms", row=1, col=col)
    fig.update_yaxes(title_text="fraction of requests", row=1, col=1)
    return styled(fig, "Latency CDFs", height=380)


def timeseries_figure(ts: TimeSeries) -> go.Figure:
    """Output throughput and the requests in each state over the run (bin averages)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["Throughput", "Requests in the system"])
    starts = [t - ts.bin_seconds / 2 for t in ts.time]  # a step per bin, from its start
    fig.add_trace(go.Scatter(x=starts, y=ts.output_throughput, name="output tokens/s",
                             line_shape="hv"), row=1, col=1)
    for name, values in [("prefill queue", ts.prefill_queue), ("prefilling", ts.prefilling),
                         ("decode queue", ts.decode_queue), ("running", ts.running),
                         ("in system", ts.in_system)]:
        fig.add_trace(go.Scatter(x=starts, y=values, name=name, line_shape="hv"), row=2, col=1)
    fig.update_yaxes(title_text="tokens/s", row=1, col=1)
    fig.update_yaxes(title_text="requests (bin mean)", row=2, col=1)
    fig.update_xaxes(title_text="time (s)", row=2, col=1)
    return styled(fig, "Throughput and requests over time", height=560)


def acceptance_figure(metrics: Metrics) -> go.Figure | None:
    """Share of speculative rounds per tokens a request gained (accepted drafts kept + 1),
    from the per-position rates; None without speculation."""
    rates = metrics.spec_decode_per_position_acceptance_rates
    if not metrics.spec_decode_num_drafts or not rates:
        return None
    k = len(rates)
    beyond = np.concatenate(([1.0], rates, [0.0]))  # [n]: share keeping n or more
    share = beyond[:-1] - beyond[1:]  # [k+1]: share keeping exactly n
    fig = go.Figure(go.Bar(x=np.arange(1, k + 2), y=share,
                           hovertemplate="%{x} tokens: %{y:.3f}<extra></extra>"))
    fig.update_layout(xaxis_title="tokens per round (accepted drafts kept + 1)",
                      yaxis_title="fraction of rounds", xaxis={"dtick": 1})
    return styled(fig, f"Acceptance length (k = {k}, mean "
                        f"{metrics.spec_decode_acceptance_length:.3f})", height=360)


def stage_time_figure(metrics: Metrics) -> go.Figure | None:
    """Busy seconds per worker, stacked by stage: where the time goes (a mixed step's
    seconds split between its decode/verify and prefill parts)."""
    seconds = metrics.stage_seconds
    if not seconds:
        return None
    workers = sorted(seconds)
    fig = go.Figure()
    for kind, color in KIND_COLORS.items():
        values = [seconds[w].get(kind, 0.0) for w in workers]
        if any(values):
            fig.add_trace(go.Bar(name=kind, y=workers, x=values, orientation="h",
                                 marker_color=color,
                                 hovertemplate=f"{kind}: %{{x:.3f}} s<extra></extra>"))
    fig.update_layout(barmode="stack", xaxis_title="busy seconds")
    return styled(fig, "Where the time goes (busy seconds per worker and stage)",
                   height=max(260, 120 + 45 * len(workers)))


# ---------------------------------------------------------------- sweeps

SWEEP_METRICS = [
    "output_throughput", "request_throughput", "request_goodput", "mean_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "spec_decode_acceptance_length",
]


def _label(value) -> str:
    return value if isinstance(value, str) else repr(value)


def sweep_curves_figure(rows: list[dict], axes: list[str],
                        metrics: list[str] = SWEEP_METRICS) -> go.Figure:
    """Each metric against the first axis, one line per combination of the other axes.

    `rows` are {"params": {axis: value}, "metrics": {name: value}}."""
    x_axis, others = axes[0], axes[1:]
    metrics = [m for m in metrics if any(r["metrics"].get(m) is not None for r in rows)]
    cols = 3
    nrows = max(1, -(-len(metrics) // cols))
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=metrics,
                        vertical_spacing=0.12 / max(1, nrows / 2))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r["params"][a] for a in others), []).append(r)
    palette = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b",
               "#ff9da6", "#9d755d", "#bab0ac"]
    for g, (key, group) in enumerate(groups.items()):
        name = ", ".join(f"{a}={_label(v)}" for a, v in zip(others, key)) or "all"
        for i, metric in enumerate(metrics):
            fig.add_trace(go.Scatter(
                x=[r["params"][x_axis] for r in group],
                y=[r["metrics"].get(metric) for r in group],
                mode="lines+markers", name=name, legendgroup=name, showlegend=i == 0,
                line_color=palette[g % len(palette)],
            ), row=i // cols + 1, col=i % cols + 1)
    for i in range(len(metrics)):
        fig.update_xaxes(title_text=x_axis, row=i // cols + 1, col=i % cols + 1)
    return styled(fig, f"Metrics against {x_axis}", height=320 * nrows + 80)


def sweep_heatmap_figure(rows: list[dict], y_axis: str, x_axis: str, metric: str) -> go.Figure:
    """`metric` over a two-axis grid (cells without a run stay blank)."""
    ys = list(dict.fromkeys(r["params"][y_axis] for r in rows))
    xs = list(dict.fromkeys(r["params"][x_axis] for r in rows))
    z = np.full((len(ys), len(xs)), np.nan)
    for r in rows:
        value = r["metrics"].get(metric)
        if value is not None:
            z[ys.index(r["params"][y_axis]), xs.index(r["params"][x_axis])] = value
    fig = go.Figure(go.Heatmap(
        z=z, x=[_label(x) for x in xs], y=[_label(y) for y in ys], colorscale="Viridis",
        text=[[f"{v:.4g}" for v in row] for row in z], texttemplate="%{text}",
        hovertemplate=f"{x_axis}=%{{x}}<br>{y_axis}=%{{y}}<br>{metric}=%{{z:.4g}}<extra></extra>",
    ))
    fig.update_layout(xaxis_title=x_axis, yaxis_title=y_axis,
                      xaxis_type="category", yaxis_type="category")
    return styled(fig, f"{metric} over {y_axis} x {x_axis}", height=420)
