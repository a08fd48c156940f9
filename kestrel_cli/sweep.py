"""`kestrel sweep`: a scenario over a grid of overrides, run in parallel processes.

`--set spec.k=1,2,4,8 --set workload.arrivals.rate=1,2,4` makes a 4 x 3 grid; a key with one
value is a plain override. Every grid point is validated, and the output folder checked,
before anything runs. Output: sweep.json, sweep.csv and sweep.html (curves against the
first axis, heatmaps for two). A grid point that fails is named by its --set values; the
others' results are written and the command exits non-zero.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kestrel_cli.outdir import output_folder
from kestrel_cli.simulate import OVERWRITE_HELP, costs_label, progress_bar
from kestrel_sim.errors import ConfigError, KestrelError
from kestrel_sim.scenario import load_scenario

SWEEP_FILES = frozenset({"sweep.json", "sweep.csv", "sweep.html"})


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


def point_name(point: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


@dataclass
class Failure:
    point: dict[str, str]
    message: str
    user_error: bool  # a KestrelError (bad input) rather than a fault in kestrel
    details: str = ""  # the traceback of a fault


def sweep_costs(scenarios) -> str:
    """The grid's costs label, or each distinct one where an axis changes the costs."""
    labels: dict[str, str] = {}
    for sc in scenarios:
        key = sc.model_dump_json(include={"hardware", "model", "draft", "costs"})
        if key not in labels:
            labels[key] = costs_label(sc)
    distinct = list(dict.fromkeys(labels.values()))
    return distinct[0] if len(distinct) == 1 else "costs by point: " + " | ".join(distinct)


def _run_point(scenario) -> dict:
    """Simulate one grid point (in a worker process, keeping no trace); its metrics as a
    dict, without the per-request arrays."""
    from kestrel_sim import simulate
    from kestrel_sim.metrics import PER_REQUEST_ARRAYS

    run = simulate(scenario, trace="none")
    return run.metrics.model_dump(exclude=set(PER_REQUEST_ARRAYS))


def _failure(point: dict[str, str], err: BaseException) -> Failure:
    if isinstance(err, KestrelError):
        return Failure(point, str(err), True)
    cause = err.__cause__  # a worker process's traceback, as concurrent.futures passes it
    details = str(cause) if cause is not None else "".join(traceback.format_exception(err))
    return Failure(point, f"{type(err).__name__}: {err}", False, details)


def run_points(scenarios, points, jobs: int, console: Console):
    """Every grid point's metrics (None where it failed) and the failures."""
    results: list[dict | None] = [None] * len(points)
    failures: list[Failure] = []
    label = f"sweep {scenarios[0].name} ({jobs} process{'es' if jobs > 1 else ''})"
    with progress_bar(console) as bar:
        task = bar.add_task(label, total=len(points))
        if jobs == 1:
            for i, sc in enumerate(scenarios):
                try:
                    results[i] = _run_point(sc)
                except Exception as err:  # noqa: BLE001  (named, kept, reported below)
                    failures.append(_failure(points[i], err))
                bar.advance(task)
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(_run_point, sc): i for i, sc in enumerate(scenarios)}
                for future in as_completed(futures):
                    i = futures[future]
                    try:
                        results[i] = future.result()
                    except Exception as err:  # noqa: BLE001  (a dead worker process too)
                        failures.append(_failure(points[i], err))
                    bar.advance(task)
    order = {point_name(p): n for n, p in enumerate(points)}
    failures.sort(key=lambda f: order[point_name(f.point)])
    return results, failures


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


def sweep(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file", show_default=False)],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="KEY=V1,V2,... sweeps a key; KEY=V overrides it (repeatable)")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", show_default="runs/NAME-sweep",
        help="output folder (NAME: the scenario's name); must be new or empty unless "
        "--overwrite")] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, show_default=f"CPU count, {os.cpu_count()}",
        help="parallel processes")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)] = False,
) -> None:
    """Run a scenario over a grid of --set values in parallel; write sweep.json, sweep.csv
    and sweep.html (curves, and heatmaps for two axes). A failing grid point is named; the
    others' results are written, and the exit status is non-zero."""
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
    jobs = min(jobs or os.cpu_count() or 1, len(points))
    axis_names = list(axes)
    with output_folder(out, overwrite, inputs=(scenario,)) as folder:
        costs = sweep_costs(scenarios)
        results, failures = run_points(scenarios, points, jobs, console)
        rows = [{"params": {k: yaml.safe_load(v) for k, v in p.items()}, "metrics": m}
                for p, m in zip(points, results) if m is not None]
        if rows:
            files = sweep_files(scenario, name, axis_names, fixed, rows, failures)
            folder.commit(files)
    if rows:
        title = f"sweep {name}: simulated, {costs}"
        if fixed:
            title += "\n" + " ".join(f"--set {f}" for f in fixed)
        Console().print(summary_table(rows, axis_names, title))
        console.print(f"ran {len(rows)} of {len(points)} scenarios with {jobs} "
                      f"process{'es' if jobs > 1 else ''}; wrote {', '.join(files)} to {out}",
                      highlight=False)
    if failures:
        report_failures(failures, len(points), out if rows else None)
