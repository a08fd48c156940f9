"""The calibration run: plan the grid on the models, build each model instance, time its
points, and hand back what was measured and what failed.

    plan = make_plan(request)                  # points per model instance, checked, estimated
    outcome = run(plan, reporter)              # records, failures (point id -> why)
    profile = to_profile(outcome.records, fingerprint(plan, outcome))

A *bench* is one model instance on one device: the target on the GPU (or the CPU), the draft
on the GPU, the draft on the CPU. Benches run one after the other, each built (weights,
quantization, backend), prepared (KV cache sized to its points, kernels compiled, graphs
captured), measured point by point, then freed. A point that fails is recorded with its id
and the run goes on; a bench that cannot be built fails all its points. `run_bench` is the
unit a later multi-GPU driver (Ray) would hand to a worker: a bench and its points, alone.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from calibration.estimate import (
    COLD_COMPILE_S,
    CPU,
    GPU,
    Estimate,
    build_seconds,
    point_seconds,
)
from calibration.grid import Grid, Point, expand
from kestrel_sim.errors import ConfigError, KestrelError

DRAFT_DEVICES = {"gpu": ("gpu",), "cpu": ("cpu",), "both": ("gpu", "cpu")}
ROTATION = 2  # KV slots per row a bench keeps where memory allows (rows rotate over them)
MIN_REPEATS = 3  # timed runs per point a --max-minutes budget may thin a grid to
KV_MEMORY_SHARE = 0.6  # of the free GPU memory after a build, at most, for KV slots


@dataclass
class Request:
    """What `kestrel calibrate` was asked (checked by the CLI)."""

    model: str
    grid: Grid
    grid_name: str
    grid_file: str
    device: str = "cuda"  # the target's torch device: "cuda", "cuda:1", "cpu"
    draft: str | None = None
    draft_device: str | None = None  # gpu | cpu | both (None: both on a GPU, cpu on the CPU)
    quant: str | None = None
    dtype: str | None = None
    commit: str | None = None


@dataclass
class BenchPlan:
    name: str  # "target@gpu"
    model: str  # preset or folder, as given
    device: str  # torch device
    dtype: str
    quant: str | None
    shape: object  # ModelShape
    points: list[Point]


@dataclass
class Plan:
    request: Request
    benches: list[BenchPlan]
    estimate: Estimate

    @property
    def points(self) -> list[Point]:
        return [p for b in self.benches for p in b.points]


@dataclass
class Outcome:
    records: list = field(default_factory=list)  # calibration.measure.Record
    failures: dict[str, str] = field(default_factory=dict)  # point id -> why
    options: dict[str, dict] = field(default_factory=dict)  # bench -> RuntimeOptions
    seconds: float = 0.0


def draft_devices(request: Request) -> tuple[str, ...]:
    if request.draft is None:
        return ()
    on_gpu = request.device.startswith("cuda")
    choice = request.draft_device or ("both" if on_gpu else "cpu")
    if choice not in DRAFT_DEVICES:
        raise KestrelError(f"--draft-device '{choice}': expected one of gpu, cpu, both")
    if not on_gpu and choice != "cpu":
        raise KestrelError(f"--draft-device {choice} needs the target on a GPU (--device "
                           f"cuda); with --device {request.device} the draft runs on the cpu")
    return DRAFT_DEVICES[choice]


def check_reach(points: list[Point], shape, what: str, grid_file: str) -> None:
    """Refuse points longer than the model's context, naming the first."""
    limit = shape.max_position_embeddings
    long = [p for p in points if p.reach > limit]
    if long:
        raise ConfigError(
            f"grid {grid_file}: point {long[0].id} reaches {long[0].reach} tokens, past "
            f"{what}'s context of {limit} (max_position_embeddings); {len(long)} point(s) "
            "do: use smaller contexts, prompts or chunks for this model")


def plan_dtype(folder, device: str) -> str:
    """The dtype a model is built in on `device` (kestrel_rt.loading.default_dtype), also on
    a machine without that device (a --dry-run plan: presets bfloat16 on CUDA)."""
    from kestrel_rt.loading import default_dtype

    try:
        return default_dtype(folder, device)
    except KestrelError:  # no CUDA here: plan as on one
        return "bfloat16" if folder is None else default_dtype(folder, "cpu")


def make_plan(request: Request) -> Plan:
    """Resolve the models (no weights read), expand the grid, check it fits, estimate."""
    from kestrel_rt.loading import resolve

    target_device = "gpu" if request.device.startswith("cuda") else "cpu"
    shape, folder = resolve(request.model)
    dtype = request.dtype or plan_dtype(folder, request.device)
    points = expand(request.grid, target_device, draft_devices(request))
    benches = [BenchPlan(f"target@{target_device}", request.model, request.device, dtype,
                         request.quant, shape, [p for p in points if p.model == "target"])]
    check_reach(benches[0].points, shape, f"model {request.model}", request.grid_file)
    if request.draft is not None:
        dshape, dfolder = resolve(request.draft)
        for device in draft_devices(request):
            torch_device = request.device if device == "gpu" else "cpu"
            mine = [p for p in points if p.bench == f"draft@{device}"]
            check_reach(mine, dshape, f"draft {request.draft}", request.grid_file)
            # the draft is not quantized; on the CPU it takes the CPU's default dtype
            ddtype = (request.dtype if device == "gpu" else None) or plan_dtype(
                dfolder, torch_device)
            benches.append(BenchPlan(f"draft@{device}", request.draft, torch_device, ddtype,
                                     None, dshape, mine))
    benches = [b for b in benches if b.points]
    if not benches:
        raise ConfigError(f"grid {request.grid_file} has no point to measure for this model "
                          "(no stage section, or only draft steps without --draft)")
    return Plan(request, benches, estimate(benches, request.grid))


def kernel_cache_filled() -> bool:
    folder = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
    return folder.is_dir() and any(folder.iterdir())


def itemsize(dtype: str) -> int:
    return 4 if "32" in dtype else 2


def estimate(benches: list[BenchPlan], grid: Grid) -> Estimate:
    t = grid.timing
    out = Estimate({}, {})
    for b in benches:
        gpu = b.device.startswith("cuda")
        speed, runs = (GPU, t.warmup + t.repeats) if gpu else (CPU, t.cpu_warmup + t.cpu_repeats)
        size = itemsize(b.dtype)
        graphs = len({(p.batch, p.m) for p in b.points if p.m <= 16}) if gpu else 0
        out.builds[b.name] = build_seconds(b.shape, speed, size, b.quant, graphs)
        if gpu and not out.compile and not kernel_cache_filled():
            out.compile = COLD_COMPILE_S
            out.builds[b.name] += COLD_COMPILE_S
        for p in b.points:
            out.points[p.id] = point_seconds(p, b.shape, speed, size, b.quant, runs)
    return out


def fit_budget(plan: Plan, minutes: float) -> Plan:
    """The plan with fewer timed runs per point (down to MIN_REPEATS) where its estimate is
    over `minutes`; a ConfigError when even that does not fit."""
    grid = plan.request.grid
    if plan.estimate.seconds <= 60 * minutes:
        return plan
    t = grid.timing
    for repeats in range(t.repeats, MIN_REPEATS - 1, -1):
        timing = t.model_copy(update={"warmup": 1, "repeats": repeats, "cpu_warmup": 1,
                                      "cpu_repeats": min(t.cpu_repeats, repeats)})
        request = replace(plan.request, grid=grid.model_copy(update={"timing": timing}))
        thinned = Plan(request, plan.benches, estimate(plan.benches, request.grid))
        if thinned.estimate.seconds <= 60 * minutes:
            return thinned
    raise ConfigError(
        f"grid {plan.request.grid_file}: estimated {plan.estimate.describe()}, over the "
        f"--max-minutes budget of {minutes:g} even at one warm-up and {MIN_REPEATS} timed "
        "runs per point; use a smaller grid (--grid quick) or a larger budget")


# -- running ------------------------------------------------------------------------------
def kv_layout(bp: BenchPlan, model, prefill_buckets: tuple[int, ...]) -> tuple[int, int]:
    """(slots, tokens per slot) of the bench's KV cache: room for every step point (a
    one-sequence prefill chunk padded to its graph bucket), and spare slots for the rows to
    rotate over where the GPU has the memory."""
    steps = [p for p in bp.points if p.stage != "kv_transfer"]
    if not steps:
        return 1, 16

    def reach(p: Point) -> int:
        if p.stage == "prefill" and p.batch == 1:
            padded = next((n for n in prefill_buckets if n >= p.m), p.m)
            return p.context + padded
        return p.reach

    max_len = max(reach(p) for p in steps) + 1
    need = max(p.slots for p in steps)
    slots = need
    if model.device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(model.device)
        per_slot = max_len * model.shape.kv_elements_per_token * model.backend.dtype.itemsize
        transfer = max((p.m for p in bp.points if p.stage == "kv_transfer"), default=0)
        room = free * KV_MEMORY_SHARE - 2 * transfer * per_slot / max_len
        slots = max(need, min(ROTATION * need, int(room // per_slot)))
    return slots, max_len


def build_bench(bp: BenchPlan, grid: Grid):
    """The bench's model, built and prepared, owning its KV slots; (Bench, options)."""
    import torch

    from calibration.measure import Bench, transfer_caches
    from kestrel_rt.options import default_options
    from kestrel_rt.runner import build_model, prepare

    options = default_options(bp.device, bp.shape, bp.quant)
    model = build_model(bp.model, bp.device, bp.dtype, bp.quant, options, seed=0)
    slots, max_len = kv_layout(bp, model, tuple(getattr(model, "prefill_buckets", ())))
    graphable = [p for p in bp.points if p.stage in ("decode", "verify", "correction", "draft")]
    batches = tuple(sorted({p.batch for p in graphable})) or (1,)
    new_tokens = sorted({p.m for p in graphable} | {p.after_k + 1 for p in graphable
                                                     if p.after_k})
    prefill = sorted({p.m for p in bp.points if p.stage == "prefill" and p.batch == 1})
    prepare(model, slots, max_len, batches, tuple(new_tokens) or (1,),
            prefill=tuple(n for n in prefill if n < max_len) or (min(32, max_len - 1),))
    kv = model.kv
    gpu = model.device.type == "cuda"
    t = grid.timing
    bench = Bench(bp.name, model, [kv.allocate() for _ in range(slots)],
                  t.warmup if gpu else t.cpu_warmup, t.repeats if gpu else t.cpu_repeats)
    biggest = max((p.m for p in bp.points if p.stage == "kv_transfer"), default=0)
    if biggest:
        bench.transfer = transfer_caches(model, biggest)
    if gpu:
        torch.cuda.synchronize(model.device)
    return bench, options.model_dump(mode="json")


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def run_bench(bp: BenchPlan, grid: Grid, outcome: Outcome, reporter,
              deadline: float | None = None) -> None:
    """Build one bench and time its points into `outcome` (failures by point id)."""
    from calibration.measure import measure

    reporter.building(bp)
    try:
        bench, options = build_bench(bp, grid)
    except Exception as err:  # noqa: BLE001 - a bench that cannot be built fails its points
        why = f"building {bp.name} ({bp.model}) failed: {describe(err)}"
        for p in bp.points:
            outcome.failures[p.id] = why
        reporter.built(bp, why)
        release(bp.device)
        return
    outcome.options[bp.name] = options
    reporter.built(bp, None)
    try:
        for p in bp.points:
            if deadline is not None and time.monotonic() > deadline:
                outcome.failures[p.id] = "skipped: the --max-minutes budget was spent"
                reporter.measured(p, None, outcome.failures[p.id])
                continue
            reporter.measuring(p)
            try:
                record = measure(bench, p)
            except Exception as err:  # noqa: BLE001 - one point fails, the others go on
                outcome.failures[p.id] = describe(err)
                reporter.measured(p, None, outcome.failures[p.id])
                release(bp.device)
                continue
            outcome.records.append(record)
            reporter.measured(p, record, None)
    finally:
        del bench
        release(bp.device)


def run(plan: Plan, reporter, max_minutes: float | None = None) -> Outcome:
    """Every bench of the plan, in order; see the module docstring."""
    t0 = time.monotonic()
    deadline = None if max_minutes is None else t0 + 60 * max_minutes
    outcome = Outcome()
    for bp in plan.benches:
        run_bench(bp, plan.request.grid, outcome, reporter, deadline)
    outcome.seconds = time.monotonic() - t0
    return outcome


def model_name(model: str) -> str:
    """The Fingerprint's `model`: a preset's name as given, a folder as its absolute path
    (which the simulator can read the shape from on this machine)."""
    from kestrel_rt.loading import looks_like_path

    return str(Path(model).expanduser().resolve()) if looks_like_path(model) else model


def fingerprint(plan: Plan, outcome: Outcome) -> dict:
    """The Profile fingerprint's fields for this run. With the draft on both devices it
    says gpu; each Measurement names its own device."""
    import torch

    from calibration.fingerprint import environment, git_commit
    from kestrel_sim.costs.shape import shape_hash

    req, target = plan.request, plan.benches[0]
    drafts = [b for b in plan.benches if b.name.startswith("draft@")]
    options = outcome.options.get(target.name)
    backend = None
    if options is not None:
        backend = options["backend"] + ("+graphs" if options.get("graphs") else "")
    return {
        **environment(torch.device(req.device)),
        "git_commit": req.commit or git_commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": model_name(req.model),
        "model_shape_hash": shape_hash(target.shape),
        "dtype": target.dtype,
        "quant": req.quant or "none",
        "draft_model": model_name(req.draft) if req.draft else None,
        "draft_shape_hash": shape_hash(drafts[0].shape) if drafts else None,
        "draft_device": drafts[0].name.split("@")[1] if drafts else None,
        "backend": backend,
        "options": dict(outcome.options),
        "grid": req.grid_name,
    }
