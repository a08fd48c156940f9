"""Running and rendering one scenario, for every command that does (`kestrel run` on either
side, `kestrel run --on both`, `kestrel validate`, `kestrel sweep`'s labels): the simulator
behind a progress bar, where its step costs come from, and a finished run's output files
(metrics.json, timeseries.json, scenario.json, trace.json, report.html)."""

from __future__ import annotations

import json

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kestrel_sim.metrics import Metrics, compute_metrics
from kestrel_sim.scenario import Scenario
from kestrel_sim.timeseries import compute_timeseries


def progress_bar(console: Console) -> Progress:
    """Shown on a terminal only, and cleared when done."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=console, transient=True)


def simulate_with_progress(scenario: Scenario, console: Console, trace: str = "sample"):
    """Run the simulator, showing finished requests on a progress bar; a SimRun."""
    from kestrel_sim import simulate

    with progress_bar(console) as bar:
        task = bar.add_task(f"simulating {scenario.name}", total=None)

        def report(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return simulate(scenario, progress=report, trace=trace)


def trace_note(trace) -> str:
    """What trace.json holds, where it is not the whole run."""
    kept = trace.meta.get("trace")
    if not isinstance(kept, dict) or kept.get("complete", True):
        return ""
    if kept.get("mode") == "none":
        return "; no trace kept (--trace none)"
    return (f"; trace.json keeps {kept['spans_kept']:,} of {kept['spans_seen']:,} spans (1 s "
            f"windows every {kept['windows_every_s']:g} s; --trace full keeps all)")


def slots_note(trace) -> str | None:
    """A warning where the simulated workers' KV slots exceed the device's memory (the
    runtime would refuse the run: kestrel_sim/sim/slots.py), else None."""
    meta = trace.meta
    if meta.get("kv_slots_fit", True) is not False:
        return None
    return (f"the runtime would refuse this scenario on {meta.get('hardware')}: its workers' "
            f"KV caches (serving.max_batch = {meta.get('max_batch')} slots each, one row of "
            "the longest request per slot, target and draft) do not fit the device's memory "
            "beside the weights. The simulator ran it with that many slots anyway; lower "
            "serving.max_batch or shorten the requests for a run the runtime can check.")


def costs_label(scenario: Scenario) -> str:
    """Where the run's step times come from ('uncalibrated roofline (h200)', ...)."""
    from kestrel_sim.costs.build import build_costs, describe_costs

    return describe_costs(build_costs(scenario, np.random.default_rng(0)))


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
        "report.html": run_report(trace, metrics, timeseries, scenario_dict),
    }
    if (trace.meta.get("trace") or {}).get("mode") != "none":
        files["trace.json"] = dumps_chrome_trace(trace)
        if include_raw:
            files["kestrel_trace.json"] = json.dumps(trace.to_dict())
    return metrics, files
