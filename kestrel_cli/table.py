"""The metrics table `kestrel run` prints: every row with its unit, latencies as mean /
median / p99, and a title that says where the step times came from and which --set
overrides made this run.

Rows name Metrics fields (kestrel_sim.metrics); a renamed field is renamed here only.
"""

from __future__ import annotations

from rich.table import Table

from kestrel_sim.metrics import Metrics

# (label, unit, Metrics field, format)
SCALARS = [
    ("completed requests", "requests", "completed", "{:d}"),
    ("duration", "s", "duration", "{:.3f}"),
    ("request throughput", "req/s", "request_throughput", "{:.3f}"),
    ("output throughput", "tok/s", "output_throughput", "{:.1f}"),
    ("total token throughput", "tok/s", "total_token_throughput", "{:.1f}"),
    ("goodput (within SLO)", "req/s", "request_goodput", "{:.3f}"),
]
# (label, key): fields mean_KEY_ms, median_KEY_ms, p99_KEY_ms
LATENCIES = [("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el")]
COLUMNS = ("metric", "unit", "mean / value", "median", "p99")


def run_title(name: str, costs: str, overrides: list[str]) -> str:
    """'NAME: simulated, COSTS' and, on a second line, the --set overrides."""
    title = f"{name}: simulated, {costs}"
    if overrides:
        title += "\n" + " ".join(f"--set {o}" for o in overrides)
    return title


def metrics_table(m: Metrics, title: str) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for label, unit, field, fmt in SCALARS:
        value = getattr(m, field)
        if value is not None:
            table.add_row(label, unit, fmt.format(value), "", "")
    for label, key in LATENCIES:
        table.add_row(label, "ms", *(f"{getattr(m, f'{s}_{key}_ms'):.2f}"
                                     for s in ("mean", "median", "p99")))
    if m.acceptance_rate is not None:
        table.add_row("draft acceptance rate", "%", f"{100 * m.acceptance_rate:.1f}", "", "")
        table.add_row("acceptance length", "tok/round", f"{m.mean_acceptance_length:.3f}", "", "")
        table.add_row("acceptance by position", "%",
                      " ".join(f"{100 * p:.0f}" for p in m.per_position_acceptance), "", "")
    for worker, busy in m.worker_utilization.items():
        table.add_row(f"utilization {worker}", "% busy", f"{100 * busy:.1f}", "", "")
    if m.stage_share:
        share = "  ".join(f"{k} {100 * v:.0f}" for k, v in m.stage_share.items())
        table.add_row("stage share", "% of busy", share, "", "")
    if m.preemptions:
        table.add_row("preemptions", "count", str(m.preemptions), "", "")
    return table
