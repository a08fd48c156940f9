"""`kestrel calibrate --ray`: a calibration's benches as Ray tasks, one GPU each, on every
kind of GPU the cluster has; one Profile per kind.

A *part* is one bench of the plan (the target, the draft on the GPU, the draft on the CPU:
calibration/driver.py `run_bench`) measured on one kind of GPU (Ray's `accelerator_type`,
"H100", "H200", ...). Every part is a task asking one GPU, placed on its kind; a part of a
CPU bench asks one too, so that it runs on a node of that kind and its fingerprint names
it. Each finished part (its Profile and failures) is saved in OUT.parts/ beside --out: a
rerun measures only the parts missing there (a part with a failed point is measured again),
and the folder is removed once every Profile is written with no failure. The parts of one
kind are merged with `Profile.merge`, which refuses parts whose setups (device, software,
options) differ. One kind writes --out; several write OUT-KIND.json beside it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from kestrel_cli.simulate import progress_bar
from kestrel_cli.task_store import TaskStore, content_key, source_digest
from kestrel_cli.tasks import run_saving
from kestrel_sim.errors import ConfigError, KestrelError

RUNTIME = ("kestrel_sim", "kestrel_rt", "calibration", "kernels")  # what a part's numbers rest on
ANY = "any"  # the kind of a cluster that names none (or a calibration on the CPU)
KIND_PREFIX = "accelerator_type:"


@dataclass
class Part:
    plan: object  # calibration.plan.Plan: the whole plan, so the fingerprint is the plan's
    bench: int  # index in plan.benches
    kind: str  # accelerator type, or ANY


def measure_part(part: Part) -> dict:
    """Run in a worker: build the part's bench, time its points; its Profile (JSON, None
    when nothing was measured) and failures."""
    from calibration.driver import Outcome, Silent, fingerprint, run_bench
    from calibration.record import to_profile

    outcome = Outcome()
    bench = part.plan.benches[part.bench]
    run_bench(bench, part.plan.request.grid, outcome, Silent())
    profile = to_profile(outcome.records, fingerprint(part.plan)) if outcome.records else None
    return {"profile": profile.model_dump(mode="json") if profile else None,
            "failures": outcome.failures}


def part_key(part: Part, code: str) -> str:
    req, bench = part.plan.request, part.plan.benches[part.bench]
    what = {"kind": part.kind, "bench": bench.name, "model": bench.model, "dtype": bench.dtype,
            "quant": bench.quant, "device": bench.device, "points": [p.id for p in bench.points],
            "grid": req.grid.model_dump(mode="json"), "commit": req.commit}
    if bench.draft is not None:  # spec@gpu: the draft beside the target, as built
        what["draft"] = [bench.draft.model, bench.draft.dtype, bench.draft.quant]
    return content_key(json.dumps(what, sort_keys=True), code)


def kinds_of(ray, gpu: bool) -> list[str]:
    """The accelerator types of the cluster's GPUs ([ANY] where it names none)."""
    if not gpu:
        return [ANY]
    found = sorted(k.removeprefix(KIND_PREFIX) for k in ray.cluster_resources()
                   if k.startswith(KIND_PREFIX))
    return found or [ANY]


def profile_path(out: Path, kind: str, kinds: list[str]) -> Path:
    return out if len(kinds) == 1 else out.with_name(f"{out.stem}-{kind}{out.suffix}")


def merged(parts: list[dict], kind: str):
    """One Profile of a kind's parts; a ConfigError where their setups differ."""
    from kestrel_sim.profile import Profile

    profiles = [Profile.model_validate(p["profile"]) for p in parts if p["profile"]]
    if not profiles:
        return None
    profile = profiles[0]
    for other in profiles[1:]:
        try:
            profile = profile.merge(other)
        except ConfigError as err:
            raise ConfigError(f"{kind}: {err}") from None
    return profile


def files_read(plan) -> tuple[str, ...]:
    """Model folders the workers read, as absolute paths (presets need none)."""
    paths = [plan.request.model, plan.request.draft]
    return tuple(sorted({str(Path(p).resolve() / "config.json") for p in paths
                         if p and Path(p).is_dir()}))


def calibrate_on_ray(plan, out: Path, address: str, console: Console) -> None:
    """Measure the plan's benches as Ray tasks and write one Profile per kind of GPU."""
    from kestrel_cli.ray_pool import RayPool

    gpu = plan.request.device.startswith("cuda")
    code = source_digest(RUNTIME)
    store = TaskStore(out.with_name(f"{out.stem}.parts"))
    pool = RayPool(address, task_gpus=1 if gpu else 0, same_code=RUNTIME,
                   files=files_read(plan), command="kestrel calibrate")
    with pool:
        kinds = kinds_of(pool.ray, gpu)
        parts = {part_key(part, code): part for part in
                 (Part(plan, i, kind) for kind in kinds for i in range(len(plan.benches)))}
        labels = {key: f"{p.plan.benches[p.bench].name} on {p.kind}" for key, p in parts.items()}
        saved = store.results(parts)
        todo = {key: part for key, part in parts.items() if key not in saved}
        if saved:
            console.print(f"resuming: {len(saved)} of {len(parts)} parts are already in "
                          f"{store.folder}", highlight=False)
        options = {key: {"accelerator_type": part.kind} for key, part in todo.items()
                   if part.kind != ANY}
        results = dict(saved)
        errors = {}
        store.folder.mkdir(parents=True, exist_ok=True)
        with progress_bar(console) as bar:
            task = bar.add_task(f"calibrating on {pool.label}", total=len(todo))
            for outcome in run_saving(pool, measure_part, todo, store, labels,
                                      keep=lambda result: not result["failures"],
                                      options=options):
                if outcome.ok:
                    results[outcome.key] = outcome.result
                else:
                    errors[outcome.key] = outcome.error
                bar.advance(task)
    try:
        write_profiles(out, kinds, parts, results, errors, labels, store, console)
    finally:
        if store.folder.is_dir() and not any(store.folder.iterdir()):
            store.folder.rmdir()  # nothing finished: leave no empty folder


def write_profiles(out: Path, kinds: list[str], parts: dict, results: dict,
                   errors: dict, labels: dict, store: TaskStore, console: Console) -> None:
    failed = {labels[k]: why for k, why in errors.items()}
    for key, result in results.items():
        for point, why in result["failures"].items():
            failed[f"{labels[key]}: {point}"] = why
    written = 0
    for kind in kinds:
        mine = [results[k] for k, p in parts.items() if p.kind == kind and k in results]
        try:
            profile = merged(mine, kind)
        except ConfigError as err:
            raise KestrelError(f"{err} (the parts measured are kept in {store.folder}, where a "
                               "rerun reads them back: remove the odd part's file, or the "
                               "folder, to measure it again)") from None
        if profile is None:
            failed.setdefault(kind, "no point was measured: no profile written")
            continue
        path = profile_path(out, kind, kinds)
        profile.save(path)
        written += 1
        console.print(f"wrote {path} ({len(profile.measurements)} measurements, "
                      f"{profile.fingerprint.device})", highlight=False)
    if failed:
        console.print(f"[bold red]{len(failed)} part(s) or point(s) failed[/] (finished parts "
                      f"are kept in {store.folder}):", highlight=False)
        for what, why in failed.items():
            console.print(f"  {escape(what)}: {escape(why)}", highlight=False)
        raise typer.Exit(1)
    if written:
        shutil.rmtree(store.folder, ignore_errors=True)
