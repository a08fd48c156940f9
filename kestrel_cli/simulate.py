"""`kestrel run`: one scenario on the simulator -> metrics table, metrics.json, trace.json,
report.html. `kestrel sweep` lives in kestrel_cli.sweep; `kestrel schema` prints the
scenario's JSON Schema.

Nothing is written until the scenario validated and the run finished; each file is written
to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kestrel_sim.errors import ConfigError
from kestrel_sim.metrics import Metrics, compute_metrics
from kestrel_sim.scenario import load_scenario
from kestrel_sim.timeseries import compute_timeseries

SET_HELP = "override a scenario key, e.g. --set spec.k=8 (repeatable; the value is YAML)"


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_out(out: Path) -> None:
    """Refuse an --out that cannot become a folder, before any work is done."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; give a folder path")


def write_outputs(out: Path, files: dict[str, str]) -> None:
    """Create `out` and write every file atomically (contents are all rendered first)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_atomic(out / name, text)


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


def simulate_with_progress(scenario, console: Console):
    """Run the simulator, showing finished requests on a progress bar."""
    from kestrel_sim import simulate

    with progress_bar(console) as bar:
        task = bar.add_task(f"simulating {scenario.name}", total=None)

        def report(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return simulate(scenario, progress=report)


def _ms(value: float) -> str:
    return f"{value:.2f}"


def metrics_table(metrics: Metrics, title: str) -> Table:
    """A rich table: throughputs, then latencies as mean / median / p99."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    for column in ("value", "median", "p99"):
        table.add_column(column, justify="right")
    m = metrics
    rows = [
        ("completed requests", str(m.completed)),
        ("duration (s)", f"{m.duration:.3f}"),
        ("request throughput (req/s)", f"{m.request_throughput:.3f}"),
        ("output throughput (tok/s)", f"{m.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{m.total_token_throughput:.1f}"),
    ]
    if m.request_goodput is not None:
        rows.append(("goodput (req/s within SLO)", f"{m.request_goodput:.3f}"))
    for name, value in rows:
        table.add_row(name, value, "", "")
    for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2el")):
        table.add_row(f"{label} (ms), mean", _ms(getattr(m, f"mean_{key}_ms")),
                      _ms(getattr(m, f"median_{key}_ms")), _ms(getattr(m, f"p99_{key}_ms")))
    if m.acceptance_rate is not None:
        table.add_row("acceptance rate", f"{m.acceptance_rate:.3f}", "", "")
        table.add_row("mean acceptance length (tok/round)", f"{m.mean_acceptance_length:.3f}",
                      "", "")
        per_pos = " ".join(f"{p:.2f}" for p in m.per_position_acceptance)
        table.add_row("per-position acceptance", per_pos, "", "")
    for worker, busy in m.worker_utilization.items():
        table.add_row(f"utilization {worker}", f"{busy:.1%}", "", "")
    if m.stage_share:
        share = "  ".join(f"{k} {v:.0%}" for k, v in m.stage_share.items())
        table.add_row("stage share of busy time", share, "", "")
    if m.preemptions:
        table.add_row("preemptions", str(m.preemptions), "", "")
    return table


def render_run(scenario, trace, include_raw: bool = False) -> tuple[Metrics, dict[str, str]]:
    """Metrics and the rendered output files of one finished run."""
    from kestrel_sim.perfetto import dumps_chrome_trace
    from reports.html import run_report

    metrics = compute_metrics(trace, scenario.slo)
    timeseries = compute_timeseries(trace)
    trace.meta.setdefault("name", scenario.name)
    scenario_dict = scenario.model_dump(mode="json")
    files = {
        "metrics.json": metrics.model_dump_json(indent=2),
        "timeseries.json": timeseries.model_dump_json(),
        "scenario.json": json.dumps(scenario_dict, indent=2),
        "trace.json": dumps_chrome_trace(trace),
        "report.html": run_report(trace, metrics, timeseries, scenario_dict),
    }
    if include_raw:
        files["kestrel_trace.json"] = json.dumps(trace.to_dict())
    return metrics, files


def run(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="output folder [default: runs/NAME]")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help=SET_HELP)] = None,
    raw_trace: Annotated[bool, typer.Option(
        "--raw-trace", help="also write the Trace itself (kestrel_trace.json)")] = False,
) -> None:
    """Run a scenario on the simulator: print metrics, write metrics.json, trace.json
    (open in ui.perfetto.dev) and report.html."""
    console = Console(stderr=True)
    sc = load_scenario(scenario, set_ or ())
    out = out or Path("runs") / sc.name
    check_out(out)
    started = time.perf_counter()
    trace = simulate_with_progress(sc, console)
    sim_wall = time.perf_counter() - started
    metrics, files = render_run(sc, trace, include_raw=raw_trace)
    write_outputs(out, files)
    Console().print(metrics_table(metrics, f"{sc.name} (simulated)"))
    speed = f", {metrics.duration / sim_wall:.0f}x real time" if sim_wall > 0 else ""
    console.print(f"simulated {metrics.duration:.2f} s in {sim_wall:.2f} s wall{speed}; "
                  f"wrote {', '.join(files)} to {out}", highlight=False)


def schema() -> None:
    """Print the scenario JSON Schema (for editors, e.g. yaml-language-server)."""
    from kestrel_sim.scenario import json_schema

    print(json.dumps(json_schema(), indent=2))
