"""The tables `kestrel run` prints: the metrics of one run (every row with its unit,
latencies as mean / median / std / p99, and a title that says where the step times came from
and which --set overrides made this run), and for `--on both` the comparison, metric by
metric (measured, predicted, error, tolerance).

Rows name Metrics fields (kestrel_sim.metrics); a renamed field is renamed here only.
"""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from kestrel_sim.comparison import Row
from kestrel_sim.metrics import Metrics

# (label, unit, Metrics field, format)
SCALARS = [
    ("completed requests", "requests", "completed", "{:d}"),
    ("failed requests", "requests", "failed", "{:d}"),
    ("duration", "s", "duration", "{:.3f}"),
    ("request throughput", "req/s", "request_throughput", "{:.3f}"),
    ("output throughput", "tok/s", "output_throughput", "{:.1f}"),
    ("peak output throughput", "tok/s", "max_output_tokens_per_s", "{:.0f}"),
    ("total token throughput", "tok/s", "total_token_throughput", "{:.1f}"),
    ("goodput (within SLO)", "req/s", "request_goodput", "{:.3f}"),
    ("peak concurrent requests", "requests", "max_concurrent_requests", "{:d}"),
]
# (label, key): fields mean_KEY_ms, median_KEY_ms, std_KEY_ms, p99_KEY_ms
LATENCIES = [("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el")]
STATS = ("mean", "median", "std", "p99")
COLUMNS = ("metric", "unit", "mean/value", "median", "std", "p99")
BLANK = ("",) * (len(STATS) - 1)


def run_title(name: str, costs: str, overrides: list[str], source: str = "simulated") -> str:
    """'NAME: simulated, COSTS' (or 'NAME: measured, DEVICE') and, on a second line, the
    --set overrides."""
    title = escape(f"{name}: {source}, {costs}")
    if overrides:  # (escaped: a value such as [cuda:0] is not rich markup)
        title += "\n" + escape(" ".join(f"--set {o}" for o in overrides))
    return title


def metrics_table(m: Metrics, title: str) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for label, unit, field, fmt in SCALARS:
        value = getattr(m, field)
        if value is not None:
            table.add_row(label, unit, fmt.format(value), *BLANK)
    for label, key in LATENCIES:
        table.add_row(label, "ms", *(f"{getattr(m, f'{s}_{key}_ms'):.2f}" for s in STATS))
    if m.spec_decode_acceptance_rate is not None:
        rows = [
            ("draft acceptance rate", "%", f"{m.spec_decode_acceptance_rate:.1f}"),
            ("acceptance length", "tok/round", f"{m.spec_decode_acceptance_length:.3f}"),
            ("acceptance by position", "%", " ".join(
                f"{100 * p:.0f}" for p in m.spec_decode_per_position_acceptance_rates)),
            ("drafts", "count", str(m.spec_decode_num_drafts)),
        ]
        for label, unit, value in rows:
            table.add_row(label, unit, value, *BLANK)
    for worker, busy in m.worker_utilization.items():
        table.add_row(f"utilization {worker}", "% busy", f"{100 * busy:.1f}", *BLANK)
    for stage, share in m.stage_share.items():
        table.add_row(f"busy time in {stage}", "%", f"{100 * share:.1f}", *BLANK)
    if m.preemptions:
        table.add_row("preemptions", "count", str(m.preemptions), *BLANK)
    return table


STATUS_STYLE = {"pass": "green", "fail": "bold red", "info": "dim", "skipped": "dim"}


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def _error(pct: float) -> str:
    if abs(pct) == float("inf"):
        return "inf"
    return f"{pct:+.1f}" if abs(pct) < 1000 else f"{pct:+.0f}"


def comparison_table(rows: list[Row], title: str) -> Table:
    """One row per metric (stage shares and utilization are left to parity.html):
    measured, predicted, error % and tolerance %, and the status (pass / fail for checked
    metrics, info for the others). Units: ms where the name ends in _ms, else as
    metrics_table's rows (per second for rates)."""
    table = Table(title=title, show_header=True, header_style="bold", box=box.SIMPLE_HEAD)
    for i, column in enumerate(("metric", "measured", "predicted", "error %", "tol %",
                                "status")):
        table.add_column(column, justify="left" if i in (0, 5) else "right", no_wrap=True)
    for r in rows:
        if r.status == "skipped" or "[" in r.metric:
            continue
        if r.error_pct is None:
            err = "-"
        else:
            err = _error(r.error_pct)
        table.add_row(escape(r.metric), _num(r.measured), _num(r.predicted), err,
                      _num(r.tolerance_pct), f"[{STATUS_STYLE[r.status]}]{r.status}[/]")
    return table


def comparison_notes(rows: list[Row]) -> list[str]:
    """'METRIC: NOTE' for each row with a note that the table leaves out (skipped rows, notes
    on checked ones); stage shares and utilization only where skipped."""
    return [f"{r.metric}: {r.note}" for r in rows if r.note]
