"""`kestrel sweep`: a scenario over a grid of overrides, run in parallel processes or as Ray
tasks.

`--set spec.k=1,2,4,8 --set workload.arrivals.rate=1,2,4` makes a 4 x 3 grid; a key with one
value is a plain override. Every grid point is validated, and the output folder checked,
before anything runs. Each point's metrics are saved in OUT/points/ as soon as it finishes
(`results_folder`), so a rerun into the same folder runs only the points not yet there.
Output: sweep.json, sweep.csv and sweep.html (curves against the first axis, heatmaps for
two). A grid point that fails is named by its --set values; the others' results are written
and the command exits non-zero. `--ray [ADDRESS]` runs the points on a local Ray instance or
a cluster (`ray_pool`), with the same results as the local processes.
"""

from __future__ import annotations

import itertools
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console

from kestrel_cli import ray_option
from kestrel_cli.results_folder import POINTS, results_folder
from kestrel_cli.simulate import OVERWRITE_HELP, costs_label, progress_bar
from kestrel_cli.sweep_output import (
    SWEEP_FILES,
    Failure,
    point_name,
    report_failures,
    summary_table,
    sweep_files,
)
from kestrel_cli.task_store import content_key, source_digest
from kestrel_cli.tasks import LocalPool, Outcome, Pool, run_saving
from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import Scenario, load_scenario

SIMULATOR = ("kestrel_sim",)  # the code a point's metrics depend on


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


# what the costs label depends on (kestrel_sim/costs/build.py: the models, the quantization,
# the cost model, and the serving keys that place workers and pick mixed or link pricing)
LABEL_FIELDS = {"hardware": True, "model": True, "quant": True, "draft": True, "costs": True,
                "spec": True,
                "serving": {"mode", "prefill_schedule", "devices", "link", "workers",
                            "prefill_workers", "decode_workers"}}


def sweep_costs(scenarios) -> str:
    """The grid's costs label, or each distinct one where an axis changes the costs."""
    labels: dict[str, str] = {}
    for sc in scenarios:
        key = sc.model_dump_json(include=LABEL_FIELDS)
        if key not in labels:
            labels[key] = costs_label(sc)
    distinct = list(dict.fromkeys(labels.values()))
    return distinct[0] if len(distinct) == 1 else "costs by point: " + " | ".join(distinct)


def simulate_point(scenario: Scenario) -> dict:
    """One grid point's metrics (in a worker, keeping no trace), without the per-request
    arrays."""
    from kestrel_sim import simulate
    from kestrel_sim.metrics import PER_REQUEST_ARRAYS

    run = simulate(scenario, trace="none")
    return run.metrics.model_dump(exclude=set(PER_REQUEST_ARRAYS))


def files_read(scenarios: list[Scenario]) -> tuple[str, ...]:
    """The files the scenarios name (a profile, an acceptance trace, a CSV): every string in
    them that is the absolute path of a file here."""
    found: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, str) and value.startswith("/") and Path(value).is_file():
            found.add(value)

    for sc in scenarios:
        walk(sc.model_dump(mode="json"))
    return tuple(sorted(found))


def open_pool(ray: str | None, jobs: int | None, todo: list[Scenario]) -> Pool:
    """The local process pool, or a Ray pool (`ray`: an address, or "local")."""
    if ray is None:
        return LocalPool(min(jobs or os.cpu_count() or 1, len(todo)))
    from kestrel_cli.ray_pool import RayPool

    return RayPool(ray, cpus=min(jobs or os.cpu_count() or 1, len(todo)), same_code=SIMULATOR,
                   files=files_read(todo), command="kestrel sweep")


def run_points(pool: Pool, todo: dict[str, Scenario], labels: dict[str, str], folder,
               name: str, console: Console) -> list[Outcome]:
    """Run the points not yet on disk, each saved as it finishes; their outcomes."""
    outcomes = []
    with ExitStack() as stack:
        with console.status(f"starting {pool.label}"):
            stack.enter_context(pool)  # a Ray instance takes seconds to start
        bar = stack.enter_context(progress_bar(console))
        task = bar.add_task(f"sweep {name} ({pool.label})", total=len(todo))
        for outcome in run_saving(pool, simulate_point, todo, folder.store, labels):
            outcomes.append(outcome)
            bar.advance(task)
    return outcomes


def sweep(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file", show_default=False)],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="KEY=V1,V2,... sweeps a key; KEY=V overrides it (repeatable)")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", show_default="runs/NAME-sweep",
        help="output folder (NAME: the scenario's name); must be new, empty or hold part of "
        "this same sweep (which then resumes), unless --overwrite")] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, show_default=f"CPU count, {os.cpu_count()}",
        help="parallel processes (with --ray alone: the local Ray instance's CPUs)")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)] = False,
    ray: Annotated[str | None, typer.Option(
        ray_option.OPTION, metavar="[ADDRESS]", show_default=False, help=ray_option.HELP)] = None,
) -> None:
    """Run a scenario over a grid of --set values in parallel; write sweep.json, sweep.csv
    and sweep.html (curves, and heatmaps for two axes). A failing grid point is named; the
    others' results are written, and the exit status is non-zero. Each point is saved in
    OUT/points/ as it finishes: a rerun into the same --out runs only what is missing."""
    console = Console(stderr=True)
    if ray is not None:
        from kestrel_cli.ray_pool import LOCAL, require_ray

        require_ray("kestrel sweep")
        if jobs is not None and ray != LOCAL:
            raise ConfigError(f"--jobs {jobs} with --ray {ray}: a cluster runs as many points "
                              "at once as it has CPUs; drop --jobs (it sizes the local pool, "
                              "or a local Ray instance)")
    fixed, axes = parse_axes(set_ or [])
    if not axes:
        raise ConfigError("kestrel sweep needs at least one --set KEY=V1,V2,... with several "
                          "values (use kestrel run for a single scenario)")
    points = grid_points(axes)
    scenarios = [load_scenario(scenario, [*fixed, *(f"{k}={v}" for k, v in p.items())])
                 for p in points]
    code = source_digest(SIMULATOR)
    keys = [content_key(sc.model_dump_json(), code) for sc in scenarios]
    labels = {key: point_name(p) for key, p in zip(keys, points)}
    name = scenarios[0].name
    out = out or Path("runs") / f"{name}-sweep"
    axis_names = list(axes)
    with results_folder(out, set(keys), overwrite, SWEEP_FILES, inputs=(scenario,)) as folder:
        costs = sweep_costs(scenarios)
        saved = folder.store.results(keys)
        todo = {key: sc for key, sc in zip(keys, scenarios) if key not in saved}
        if saved:
            console.print(f"resuming: {len(set(keys) & set(saved))} of {len(set(keys))} grid "
                          f"points are already in {out / POINTS}", highlight=False)
        pool = open_pool(ray, jobs, list(todo.values())) if todo else None
        outcomes = run_points(pool, todo, labels, folder, name, console) if pool else []
        results = {**saved, **{o.key: o.result for o in outcomes if o.ok}}
        errors = {o.key: o for o in outcomes if not o.ok}
        rows = [{"params": {k: yaml.safe_load(v) for k, v in p.items()}, "metrics": results[key]}
                for p, key in zip(points, keys) if key in results]
        failures = [Failure(p, errors[key].error, errors[key].user_error, errors[key].details)
                    for p, key in zip(points, keys) if key in errors]
        if rows:
            files = sweep_files(scenario, name, axis_names, fixed, rows, failures)
            folder.finish(files)
    if rows:
        title = f"sweep {name}: simulated, {costs}"
        if fixed:
            title += "\n" + " ".join(f"--set {f}" for f in fixed)
        Console().print(summary_table(rows, axis_names, title))
        ran = len(rows) - sum(1 for key in keys if key in saved)
        how = f" with {pool.label}" if pool else ""
        reused = f" and read {len(rows) - ran} from {out / POINTS}" if saved else ""
        console.print(f"ran {ran} of {len(points)} scenarios{how}{reused}; wrote "
                      f"{', '.join(files)} to {out}", highlight=False)
    if failures:
        report_failures(failures, len(points), out if rows else None)
