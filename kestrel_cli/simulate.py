"""`kestrel run`: one scenario on the simulator -> metrics table, metrics.json, trace.json,
report.html; `--on hardware` runs it on this machine's runtime (kestrel_cli.run_hardware)
and writes the same files; `--on both` runs both and compares them (kestrel_cli.compare),
exiting 1 when a checked metric is past the scenario's tolerance. `kestrel sweep` lives in
kestrel_cli.sweep; `kestrel schema` prints the scenario's JSON Schema.

The scenario and the output folder are checked before anything runs; the outputs are
rendered in full and put in place at once (kestrel_cli.outdir), so a failure leaves
nothing half-written.
"""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kestrel_cli.outdir import output_folder
from kestrel_cli.render import (  # noqa: F401  (progress_bar: re-exported for kestrel sweep)
    costs_label,
    progress_bar,
    render_run,
    simulate_with_progress,
    slots_note,
    trace_note,
)
from kestrel_cli.table import (
    comparison_notes,
    comparison_table,
    metrics_table,
    run_title,
)
from kestrel_sim.errors import ConfigError, OutputError
from kestrel_sim.scenario import Scenario, load_scenario
from kestrel_sim.sim.keep import SAMPLE_SPANS

SET_HELP = "override a scenario key, e.g. --set spec.k=8 (repeatable; the value is YAML)"
OVERWRITE_HELP = "replace an existing --out folder that holds anything else"
# every file a run may write: an earlier run's folder holding only these is replaced
RUN_FILES = frozenset({"metrics.json", "timeseries.json", "scenario.json", "trace.json",
                       "report.html", "kestrel_trace.json"})
BOTH_FILES = frozenset({"hardware", "sim", "parity.html", "comparison.json"})  # --on both


class OnChoice(str, Enum):
    sim = "sim"
    hardware = "hardware"
    both = "both"


class TraceChoice(str, Enum):
    full = "full"
    sample = "sample"
    none = "none"


def run(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", show_default="runs/NAME",
        help="output folder (NAME: the scenario's name); an earlier run's folder is "
        "replaced")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help=SET_HELP)] = None,
    on: Annotated[OnChoice, typer.Option(
        "--on", help="sim: the simulator predicts; hardware: this machine's runtime measures "
        "(the scenario's hardware must be this device); both: measure and predict, write "
        "both (OUT/hardware, OUT/sim), a comparison table and OUT/parity.html, and exit 1 "
        "when a checked metric is past validate.tolerance_pct")] = OnChoice.sim,
    raw_trace: Annotated[bool, typer.Option(
        "--raw-trace", help="also write the Trace itself (kestrel_trace.json)")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)] = False,
    trace: Annotated[TraceChoice, typer.Option(
        "--trace", help="the timeline kept in trace.json and the report: every span, a "
        f"sample (all up to {SAMPLE_SPANS:,} spans, then evenly spread 1 s windows) or none; "
        "metrics are the same whichever (a run on hardware keeps every span)")
    ] = TraceChoice.sample,
    measured: Annotated[Path | None, typer.Option(
        "--measured", help="with --on both: predict against the measurement kept in this "
        "earlier --on both output folder (or a bundle of kept runs: measured.json.gz) instead of "
        "measuring again")] = None,
) -> None:
    """Run a scenario on the simulator (or, with --on, on this machine's runtime, or both):
    print metrics, write metrics.json, trace.json (open in ui.perfetto.dev) and
    report.html."""
    console = Console(stderr=True)
    if raw_trace and trace is TraceChoice.none:
        raise OutputError("--raw-trace writes the kept trace: it needs --trace full or sample")
    overrides = list(set_ or ())
    sc = load_scenario(scenario, overrides)
    out = out or Path("runs") / sc.name
    if measured is not None and on is not OnChoice.both:
        raise ConfigError("--measured compares a prediction with a kept measurement: it "
                          "needs --on both")
    if on is OnChoice.both:
        return run_both_command(sc, out, overrides, scenario, overwrite, trace, raw_trace,
                                measured)
    with output_folder(out, overwrite, RUN_FILES, inputs=(scenario,)) as folder:
        started = time.perf_counter()
        if on is OnChoice.hardware:
            from kestrel_cli.compare import refuse_pending
            from kestrel_cli.run_hardware import run_on_hardware

            refuse_pending(sc)
            run_ = run_on_hardware(sc, console)
            title = run_title(sc.name, str(run_.meta.get("device")), overrides, "measured")
        else:
            title = run_title(sc.name, costs_label(sc), overrides)
            run_ = simulate_with_progress(sc, console, trace.value)
        wall = time.perf_counter() - started
        metrics, files = render_run(sc, run_, include_raw=raw_trace)
        if trace is TraceChoice.none:
            files.pop("trace.json", None)
        folder.commit(files)
    Console().print(metrics_table(metrics, title))
    if on is OnChoice.hardware:
        what = f"ran {metrics.duration:.2f} s of serving in {wall:.2f} s wall"
    else:
        speed = f", {metrics.duration / wall:.0f}x real time" if wall > 0 else ""
        what = f"simulated {metrics.duration:.2f} s in {wall:.2f} s wall{speed}"
    console.print(f"{what}; wrote {', '.join(files)} to {out}{trace_note(run_)}",
                  highlight=False)
    if sc.spec is not None and on is not OnChoice.hardware:
        console.print(acceptance_line(sc), highlight=False)
    note = slots_note(run_)
    if note is not None:
        console.print(f"[yellow]warning:[/] {note}", highlight=False)


def run_both_command(sc: Scenario, out: Path, overrides: list[str], scenario: Path,
                     overwrite: bool, trace: TraceChoice, raw_trace: bool,
                     measured: Path | None = None) -> None:
    """`kestrel run --on both`: write both runs and the comparison; exit 1 on a failure.
    With `measured`, the hardware side is the measurement kept there (kestrel_cli/kept.py)."""
    from kestrel_cli.compare import kept_both, run_both
    from kestrel_cli.kept import kept_run

    console = Console(stderr=True)
    kept = None
    if measured is not None:  # predicted before OUT is replaced: OUT may be the source
        kept = kept_both(sc, kept_run(measured, sc.model_dump(mode="json")), measured,
                         console, trace.value)
    with output_folder(out, overwrite, RUN_FILES | BOTH_FILES, inputs=(scenario,)) as folder:
        both = kept or run_both(sc, console, trace.value, raw_trace)
        files = both.files
        if trace is TraceChoice.none:
            files = {k: v for k, v in files.items() if not k.endswith("/trace.json")}
        folder.commit(files)
    title = run_title(sc.name, f"measured on {both.measured_on} against predicted with "
                      f"{both.predicted_with}", overrides, "compared")
    Console().print(comparison_table(both.rows, title))
    for line in comparison_notes(both.rows):
        console.print(f"note: {line}", highlight=False)
    if sc.spec is not None:
        console.print(f"note: predicted with {acceptance_line(sc)}", highlight=False)
    checked = sum(r.status in ("pass", "fail") for r in both.rows)
    console.print(f"wrote hardware/, sim/, parity.html and comparison.json to {out}",
                  highlight=False)
    if both.failed:
        listed = ", ".join(f"{r.metric} {r.error_pct:+.1f}% (tolerance {r.tolerance_pct:g}%)"
                           for r in both.failed)
        console.print(f"[bold red]FAIL[/]: {len(both.failed)} of {checked} checked metrics "
                      f"past tolerance: {listed}", highlight=False)
        raise typer.Exit(1)
    console.print(f"[green]PASS[/]: all {checked} checked metrics within tolerance",
                  highlight=False)


def acceptance_line(sc: Scenario) -> str:
    """Where the simulator's accepted lengths come from (given, or measured on a device)."""
    from kestrel_sim.acceptance import describe_acceptance

    return f"acceptance: {describe_acceptance(sc.spec.acceptance, sc.spec.k)}"


def schema() -> None:
    """Print the scenario JSON Schema (for editors, e.g. yaml-language-server)."""
    from kestrel_sim.scenario import json_schema

    print(json.dumps(json_schema(), indent=2))
