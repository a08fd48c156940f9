"""`kestrel calibrate`: time the runtime's stages over a grid and write a Profile.

    kestrel calibrate --model qwen3-8b --draft qwen3-0.6b --out profile.json
    kestrel calibrate --model qwen3-8b --quant int4 --grid quick --max-minutes 3 --out p.json
    kestrel calibrate --model qwen3-0.6b --draft qwen3-0.6b --draft-quant int4-last-14 \
        --draft-device gpu --out organic.json      # the organic pair: a quantized copy
    kestrel calibrate --model tiny/ --device cpu --grid tiny --out p.json
    kestrel calibrate --model qwen3-8b --draft qwen3-0.6b --ray ray://head:10001 --out p.json
    kestrel calibrate --model qwen3-8b --draft qwen3-0.6b --draft-device cpu --grid cpu.yaml \
        --update p.json --out p.json      # re-measure the CPU draft's steps into p.json

The grid (calibration/grids/*.yaml or a file, calibration/grid.py) is checked and the run
estimated (printed) before any model is built. A point that fails is named and the others
go on; the Profile holds what was measured, is written at once (never half), and the command
exits 1 when any point failed or was skipped, 2 on a usage error (bad grid, model, option).
With --update BASE, what is written is BASE with this run's rows in place of BASE's rows
of the same (stage, device) pairs (Profile.replace_rows).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kestrel_sim.errors import ConfigError, KestrelError, OutputError


class ProgressReporter:
    """A progress bar over the plan's estimated seconds (so the ETA weighs long points and
    model builds as they are), with the current point and failures as they happen."""

    def __init__(self, console: Console, plan):
        self.console, self.plan = console, plan
        self.bar = Progress(TextColumn("{task.description}", style="cyan"), BarColumn(),
                            TextColumn("{task.fields[done]}/{task.fields[points]} points"),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            console=console, transient=True)
        self.task = self.bar.add_task("starting", total=plan.estimate.seconds, done=0,
                                      points=len(plan.estimate.points))
        self.done = 0

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def building(self, bp) -> None:
        self.bar.update(self.task, description=f"building {bp.name} ({bp.model})")
        self.started = time.monotonic()

    def built(self, bp, error: str | None) -> None:
        estimate = self.plan.estimate.builds.get(bp.name, 0.0)
        self.bar.advance(self.task, estimate)
        if error:
            self.console.print(f"[bold red]failed[/] {escape(error)}", highlight=False)
        else:
            self.console.print(f"built {bp.name} ({escape(bp.model)}, {bp.dtype}"
                               f"{', ' + bp.quant if bp.quant else ''}) in "
                               f"{time.monotonic() - self.started:.1f} s (estimated "
                               f"{estimate:.0f} s); {len(bp.points)} points", highlight=False)

    def measuring(self, point) -> None:
        self.bar.update(self.task, description=point.id)

    def measured(self, point, record, error: str | None) -> None:
        self.done += 1
        self.bar.update(self.task, done=self.done)
        self.bar.advance(self.task, self.plan.estimate.points.get(point.id, 0.0))
        if error:
            self.console.print(f"[bold red]failed[/] {point.id}: {escape(error)}",
                               highlight=False)

    def measuring_acceptance(self, ap) -> None:
        self.bar.update(self.task, description=f"{ap.name}: building the pair, "
                        f"{ap.prompts * ap.rounds} drafts at k = {ap.k}")

    def measured_acceptance(self, ap, block, error: str | None) -> None:
        self.bar.advance(self.task, self.plan.estimate.builds.get(ap.name, 0.0))
        if error:
            self.console.print(f"[bold red]failed[/] {ap.name}: {escape(error)}",
                               highlight=False)
            return
        rates = " ".join(f"{r:.2f}" for r in block.conditional_rates)
        self.console.print(f"measured the pair's acceptance in {block.seconds:.1f} s "
                           f"(estimated {self.plan.estimate.builds.get(ap.name, 0):.0f} s): "
                           f"{block.drafts} drafts at k = {block.k}, conditional per "
                           f"position {rates}, acceptance length "
                           f"{block.acceptance_length():.2f}", highlight=False)


def check_out(out: Path) -> None:
    """Refuse, before measuring, an --out that cannot be written."""
    if out.is_dir():
        raise OutputError(f"--out {out} is a folder; expected a file name, e.g. "
                          f"{out / 'profile.json'}")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise OutputError(f"--out {out}: folder {parent} does not exist")


def load_base(update: Path, ray: str | None):
    """The --update profile, read before measuring (a ConfigError naming the file)."""
    from kestrel_sim.profile import Profile

    if ray is not None:
        raise KestrelError("--update with --ray: Ray writes a Profile per kind of GPU; "
                           "measure into --out, then apply it: Profile.load(BASE)"
                           ".replace_rows(Profile.load(OUT)).save(BASE)")
    try:
        return Profile.load(update)
    except ConfigError as err:
        raise ConfigError(f"--update: {err}") from None


def check_device(device: str) -> None:
    from kestrel_rt.weights import parse_device

    parse_device(device)  # a KestrelError naming what is missing


def print_fit_report(console: Console, plan, profile, name: str) -> None:
    """The held-out errors of the simulator's fits to this profile (kestrel_sim's
    fit_report, given the measured shapes); the profile is written already, so a fit that
    fails is only reported."""
    try:
        from kestrel_sim.costs.profile import ProfileFits
        from kestrel_sim.costs.report import fit_report
    except ImportError:
        return
    shapes = {b.name.split("@")[0]: b.shape for b in plan.benches}
    try:
        fits = ProfileFits(profile, shapes.get("target"), shapes.get("draft"))
        text = fit_report(profile, name, fits=fits).table()
    except Exception as err:  # noqa: BLE001 - the measurements stand; the fit is a report
        console.print(f"[yellow]fit report failed[/]: {escape(f'{type(err).__name__}: {err}')}",
                      highlight=False)
        return
    console.print(escape(text), highlight=False)


def calibrate(
    model: Annotated[str, typer.Option(
        help="The target: a preset (qwen3-8b: random weights, real shapes) or a Hugging Face "
        "model folder.")],
    out: Annotated[Path | None, typer.Option(
        help="The Profile JSON to write (replaced at once when done).")] = None,
    update: Annotated[Path | None, typer.Option(metavar="BASE.json",
        help="BASE, with this run's rows replacing its rows of the same stage and device.")] = None,
    draft: Annotated[str | None, typer.Option(
        help="A draft model (preset or folder): its steps are measured too.")] = None,
    draft_device: Annotated[str | None, typer.Option(
        help="Where the draft steps are measured: gpu, cpu or both (default: both with "
        "--device cuda, cpu with --device cpu).")] = None,
    quant: Annotated[str | None, typer.Option(
        help="none, int8 or int4: the target's projections quantized at load.")] = None,
    draft_quant: Annotated[str | None, typer.Option(
        help="none, int8, int4 or int4-last-N (int4 in the last N layers, int8 in the "
        "others): the draft's projections quantized at load, as a scenario's draft.quant; "
        "a draft of the target's own preset so quantized is its organic copy.")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="bfloat16, float16 or float32 (default: bfloat16 on CUDA for presets, the "
        "folder's dtype, float32 on the CPU).")] = None,
    grid: Annotated[str, typer.Option(
        help="A bundled grid (default, quick, tiny) or a grid YAML file.")] = "default",
    device: Annotated[str, typer.Option(help="cuda[:N] or cpu: where the target runs.")] = "cuda",
    max_minutes: Annotated[float | None, typer.Option(
        min=0.1, help="A time budget: fewer timed runs per point where the estimate is over "
        "it (an error if even 3 are); measuring stops once it is spent.")] = None,
    commit: Annotated[str | None, typer.Option(
        help="The code's commit for the fingerprint (default: git rev-parse HEAD).")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the plan and its time estimate; build nothing.")] = False,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="[ADDRESS]", show_default=False,
        help="Measure on Ray: each bench a task with one GPU, on every kind of GPU of the "
        "cluster (--ray ray://HEAD:10001 or HEAD:6379; --ray alone: a local instance); "
        "one Profile per kind (OUT-KIND.json when several); needs pip install "
        "'kestrel\\[ray]'.")] = None,
) -> None:
    """Measure the runtime's stage costs over a grid and write a Profile for the simulator."""
    from calibration.grid import load_grid
    from calibration.plan import Request, fit_budget, make_plan, peer_gpu, without_acceptance

    console = Console(stderr=True, soft_wrap=True)
    the_grid, name = load_grid(grid)  # before torch: a bad grid fails fast
    if out is None and not dry_run:
        raise KestrelError("--out FILE.json is required (or --dry-run to see the plan)")
    if out is not None:
        check_out(out)
    base = load_base(update, ray) if update is not None else None
    if ray is not None:
        from kestrel_cli.ray_pool import require_ray

        require_ray("kestrel calibrate")
        if max_minutes is not None:
            raise KestrelError("--max-minutes budgets a run on this machine; with --ray the "
                               "benches run apart, so give a smaller grid instead")
        if device not in ("cuda", "cpu"):
            raise KestrelError(f"--device {device} with --ray: Ray gives each task its own "
                               "GPU, so say --device cuda (or cpu)")
    if not dry_run and ray is None:  # a plan needs no device; with --ray, the workers' count
        check_device(device)
    request = Request(model, the_grid, name, grid, device, draft, draft_device,
                      check_quant_option(quant, model), dtype, commit,
                      peer=None if ray is not None else peer_gpu(device),
                      draft_quant=check_draft_quant_option(draft_quant, draft))
    plan = make_plan(request)
    if ray is not None:  # the workers measure grid points; the acceptance is not one
        plan = without_acceptance(plan, "run without --ray to measure it")
    for line in plan.notes:
        console.print(f"note: {line}", highlight=False)
    if max_minutes is not None:
        plan = fit_budget(plan, max_minutes)
    t = plan.request.grid.timing
    drafted = f" + draft {draft}" + (f" ({request.draft_quant})" if request.draft_quant else "")
    console.print(f"calibrating {model}" + (drafted if draft else "")
                  + f" on {device}, grid {name}: {len(plan.points)} points on "
                  + ", ".join(b.name for b in plan.benches)
                  + f"; {t.warmup} warm-up + {t.repeats} timed runs per point (CPU "
                  f"{t.cpu_warmup} + {t.cpu_repeats})", highlight=False)
    console.print(f"estimated {plan.estimate.describe()}", highlight=False)
    if dry_run:
        for p in plan.points:
            print(f"{p.id}\t{plan.estimate.points[p.id]:.2f} s")
        return
    if ray is not None:
        from kestrel_cli.calibrate_ray import calibrate_on_ray

        calibrate_on_ray(plan, out, ray, console)
        return
    measure_and_write(plan, out, console, max_minutes, base)


def check_quant_option(quant: str | None, model: str) -> str | None:
    """The --quant value the runtime takes (None: unquantized), refusing what cannot apply."""
    from kestrel_cli.generate import check_quant
    from kestrel_rt.loading import is_awq_checkpoint, resolve

    shape, folder = resolve(model)
    awq = folder is not None and is_awq_checkpoint(folder)
    where = f"model folder {folder}" if folder is not None else f"preset '{model}'"
    chosen = check_quant(quant, shape, awq, where)
    return None if chosen == "none" else chosen


def check_draft_quant_option(draft_quant: str | None, draft: str | None) -> str | None:
    """The --draft-quant value the runtime takes (None: unquantized), checked as a
    scenario's draft.quant is (kestrel_sim.quant_spec) and against the draft's shape."""
    from kestrel_cli.generate import OptionError
    from kestrel_rt.loading import is_awq_checkpoint, resolve
    from kestrel_rt.quant import GROUP_SIZE, int4_fits
    from kestrel_rt.quant_weights import is_projection, mode_of
    from kestrel_rt.weights import expected_tensors
    from kestrel_sim.quant_spec import check_quant, int4_last

    if draft_quant is None:
        return None
    try:
        check_quant(draft_quant)
    except ValueError as err:
        raise OptionError(f"--draft-quant {err}") from None
    if draft is None and draft_quant != "none":
        raise OptionError(f"--draft-quant {draft_quant} quantizes the draft, but no --draft "
                          "was given: add --draft MODEL (e.g. the target's own preset, for "
                          "its organic copy)")
    if draft_quant == "none":
        return None
    shape, folder = resolve(draft)
    where = f"draft folder {folder}" if folder is not None else f"draft preset '{draft}'"
    if folder is not None and is_awq_checkpoint(folder) and draft_quant != "int4":
        raise OptionError(f"--draft-quant {draft_quant} cannot apply to {where}: it is an "
                          "AWQ checkpoint (int4) and loads as it is; leave --draft-quant out")
    layers = shape.num_hidden_layers
    if (int4_last(draft_quant) or 0) > layers:
        raise OptionError(f"--draft-quant {draft_quant}: {where} has {layers} layers")
    for name, dims in expected_tensors(shape).items():
        if (is_projection(name) and mode_of(name, draft_quant, layers) == "int4"
                and not int4_fits(dims[-2], dims[-1])):
            raise OptionError(
                f"--draft-quant {draft_quant} cannot apply to {where}: tensor '{name}' has "
                f"shape {list(dims)}, and int4 needs in_features a multiple of {GROUP_SIZE} "
                "and out_features a multiple of 8; use --draft-quant int8")
    return draft_quant


def measure_and_write(plan, out: Path, console: Console, max_minutes: float | None,
                      base=None) -> None:
    from calibration.driver import fingerprint, run
    from calibration.record import to_profile

    with ProgressReporter(console, plan) as reporter:
        outcome = run(plan, reporter, max_minutes)
    failed = outcome.failures
    console.print(f"measured {len(outcome.records)} of {len(plan.points)} points in "
                  f"{outcome.seconds / 60:.1f} min (estimated "
                  f"{plan.estimate.seconds / 60:.1f} min)", highlight=False)
    if not outcome.records:
        console.print("[bold red]no point was measured[/]: no profile written")
        raise typer.Exit(1)
    profile = to_profile(outcome.records, fingerprint(plan), outcome.acceptance)
    if base is not None:
        profile = updated(base, profile, out)
    profile.save(out)
    console.print(f"wrote {out} ({len(profile.measurements)} measurements)", highlight=False)
    print_fit_report(console, plan, profile, str(out))
    if failed:
        console.print(f"[bold red]{len(failed)} point(s) failed[/]:", highlight=False)
        for point_id, why in failed.items():
            console.print(f"  {point_id}: {escape(why)}", highlight=False)
        raise typer.Exit(1)


def updated(base, part, out: Path):
    """BASE with this run's rows in place of its rows of the same (stage, device); where
    they cannot go in, this run's profile is kept beside --out and the error says where."""
    try:
        return base.replace_rows(part)
    except ConfigError as err:
        kept = out.with_name(f"{out.stem}.part{out.suffix}")
        part.save(kept)
        raise ConfigError(f"--update: {err}; this run's measurements are in {kept}") from None
