"""`kestrel sweep`: a scenario over a grid of overrides, run in parallel processes.

`--set spec.k=1,2,4,8 --set workload.arrivals.rate=1,2,4` makes a 4 x 3 grid; a key with one
value is a plain override. Every grid point is validated before anything runs or is written.
Output: sweep.json, sweep.csv and sweep.html (curves against the first axis, heatmaps for two).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.table import Table

from kestrel_cli.simulate import check_out, progress_bar, write_outputs
from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import load_scenario


def split_values(text: str) -> list[str]:
    """"1,2,[3,4]" -> ["1", "2", "[3,4]"]: commas outside brackets and quotes split."""
    parts, depth, quote, current = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += ch
    parts.append(current)
    return [p.strip() for p in parts]


def parse_axes(sets: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Fixed overrides ("k=v") and grid axes (key -> raw values, in the order given)."""
    fixed: list[str] = []
    axes: dict[str, list[str]] = {}
    for text in sets:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {text}: expected KEY.PATH=VALUE[,VALUE...], e.g. spec.k=1,2,4")
        values = split_values(raw)
        if len(values) == 1:
            fixed.append(f"{key.strip()}={raw}")
        elif key.strip() in axes:
            raise ConfigError(f"--set {text}: {key.strip()} is swept twice")
        else:
            axes[key.strip()] = values
    return fixed, axes


def grid_points(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def _run_point(scenario) -> dict:
    """Simulate one grid point (in a worker process); return its metrics as a dict."""
    from kestrel_sim import simulate
    from kestrel_sim.metrics import compute_metrics

    return compute_metrics(simulate(scenario), scenario.slo).model_dump()


def sweep_csv(rows: list[dict], axes: list[str]) -> str:
    metric_names = [k for k, v in rows[0]["metrics"].items() if not isinstance(v, (list, dict))]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([*axes, *metric_names])
    for r in rows:
        writer.writerow([r["params"][a] for a in axes] + [r["metrics"][m] for m in metric_names])
    return buf.getvalue()


SUMMARY = {"output_throughput": "out tok/s", "request_throughput": "req/s",
           "request_goodput": "goodput", "mean_ttft_ms": "TTFT ms", "p99_ttft_ms": "p99 TTFT",
           "mean_tpot_ms": "TPOT ms", "mean_acceptance_length": "tok/round"}


def summary_table(rows: list[dict], axes: list[str]) -> Table:
    """Axes (by their last key) and a few headline metrics, one row per grid point."""
    table = Table(title="sweep", header_style="bold")
    for name in [*(a.rsplit(".", 1)[-1] for a in axes), *SUMMARY.values()]:
        table.add_column(name, justify="right")
    for r in rows:
        cells = [str(r["params"][a]) for a in axes]
        cells += ["-" if r["metrics"].get(m) is None else f"{r['metrics'][m]:.4g}" for m in SUMMARY]
        table.add_row(*cells)
    return table


def sweep(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file", show_default=False)],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="KEY=V1,V2,... sweeps a key; KEY=V overrides it (repeatable)")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="output folder [default: runs/NAME-sweep]")] = None,
    jobs: Annotated[int, typer.Option(
        "--jobs", "-j", help="parallel processes [default: CPU count]")] = 0,
) -> None:
    """Run a scenario over a grid of --set values in parallel; write sweep.json, sweep.csv
    and sweep.html (curves, and heatmaps for two axes)."""
    from reports.html import sweep_report

    console = Console(stderr=True)
    fixed, axes = parse_axes(set_ or [])
    if not axes:
        raise ConfigError("kestrel sweep needs at least one --set KEY=V1,V2,... with several "
                          "values (use kestrel run for a single scenario)")
    points = grid_points(axes)
    scenarios = [load_scenario(scenario, [*fixed, *(f"{k}={v}" for k, v in p.items())])
                 for p in points]
    name = scenarios[0].name
    out = out or Path("runs") / f"{name}-sweep"
    check_out(out)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(points)))

    results: list[dict | None] = [None] * len(points)
    with progress_bar(console) as bar:
        task = bar.add_task(f"sweep {name} ({jobs} processes)", total=len(points))
        if jobs == 1:
            for i, sc in enumerate(scenarios):
                results[i] = _run_point(sc)
                bar.advance(task)
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(_run_point, sc): i for i, sc in enumerate(scenarios)}
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.advance(task)

    axis_names = list(axes)
    rows = [{"params": {k: yaml.safe_load(v) for k, v in p.items()}, "metrics": m}
            for p, m in zip(points, results)]
    doc = {"scenario": str(scenario), "name": name, "axes": axis_names, "fixed": fixed,
           "rows": rows}
    files = {
        "sweep.json": json.dumps(doc, indent=2),
        "sweep.csv": sweep_csv(rows, axis_names),
        "sweep.html": sweep_report(name, rows, axis_names),
    }
    write_outputs(out, files)
    Console().print(summary_table(rows, axis_names))
    console.print(f"ran {len(points)} scenarios with {jobs} processes; wrote "
                  f"{', '.join(files)} to {out}", highlight=False)
