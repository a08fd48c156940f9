"""What `kestrel sweep` writes and prints: sweep.json, sweep.csv, sweep.html, the summary
table, and the report of failed grid points."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kestrel_sim.errors import KestrelError

SWEEP_FILES = frozenset({"sweep.json", "sweep.csv", "sweep.html"})


def point_name(point: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


@dataclass
class Failure:
    point: dict[str, str]
    message: str
    user_error: bool  # a KestrelError (bad input) rather than a fault in kestrel
    details: str = ""  # the traceback of a fault


def sweep_csv(rows: list[dict], axes: list[str]) -> str:
    metric_names = [k for k, v in rows[0]["metrics"].items() if not isinstance(v, (list, dict))]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([*axes, *metric_names])
    for r in rows:
        writer.writerow([r["params"][a] for a in axes] + [r["metrics"][m] for m in metric_names])
    return buf.getvalue()


SUMMARY = {"output_throughput": "out tok/s", "request_throughput": "req/s",
           "request_goodput": "goodput req/s", "mean_ttft_ms": "TTFT ms",
           "p99_ttft_ms": "p99 TTFT ms", "mean_tpot_ms": "TPOT ms",
           "spec_decode_acceptance_length": "tok/round"}


def summary_table(rows: list[dict], axes: list[str], title: str) -> Table:
    """Axes (by their last key) and a few headline metrics, one row per grid point."""
    table = Table(title=title, header_style="bold")
    for name in [*(a.rsplit(".", 1)[-1] for a in axes), *SUMMARY.values()]:
        table.add_column(name, justify="right")
    for r in rows:
        cells = [str(r["params"][a]) for a in axes]
        cells += ["-" if r["metrics"].get(m) is None else f"{r['metrics'][m]:.4g}" for m in SUMMARY]
        table.add_row(*cells)
    return table


def sweep_files(scenario: Path, name: str, axes: list[str], fixed: list[str], rows: list[dict],
                failures: list[Failure]) -> dict[str, str]:
    from reports.html import sweep_report

    failed = [{"params": {k: yaml.safe_load(v) for k, v in f.point.items()}, "error": f.message}
              for f in failures]
    doc = {"scenario": str(scenario), "name": name, "axes": axes, "fixed": fixed,
           "rows": rows, "failed": failed}
    return {
        "sweep.json": json.dumps(doc, indent=2),
        "sweep.csv": sweep_csv(rows, axes),
        "sweep.html": sweep_report(name, rows, axes),
    }


def report_failures(failures: list[Failure], total: int, out: Path | None) -> None:
    """Print each failed point and exit: 2 where every failure is bad input, else 1."""
    kept = (f"the other {total - len(failures)} points' results are in {out}" if out
            else "nothing was written")
    lines = [f"grid point {point_name(f.point)}: {f.message}" for f in failures]
    summary = f"{len(failures)} of {total} grid points failed ({kept}):\n" + "\n".join(lines)
    if all(f.user_error for f in failures):
        raise KestrelError(summary)
    console = Console(stderr=True, soft_wrap=True)
    for f in failures:
        if f.details:
            console.print(f"grid point {escape(point_name(f.point))}:\n{escape(f.details)}",
                          highlight=False)
    console.print(f"[bold red]error:[/] {escape(summary)}", highlight=False)
    raise typer.Exit(1)
