"""A calibration's plan: the grid's points per model instance, checked against the
models, and the run's time estimate, before anything is built.

    plan = make_plan(Request("qwen3-8b", grid, "default", "default", "cuda", "qwen3-0.6b"))
    plan.estimate.describe()                   # "about 3.2 min: 270 points ..."
    plan = fit_budget(plan, minutes=5)         # fewer timed runs, where over a budget

A *bench* is one model instance on one device: the target on the GPU (or the CPU), the draft
on the GPU, the draft on the CPU; its points are the grid points that instance measures. The
bench `pair@gpu` is two instances of the target on one GPU, for the overlap points
(calibration/overlap.py; with draft overlap points, its `draft` the draft's BenchPlan, a
third instance); the bench `spec@gpu` the target and the draft on one GPU (its
`draft` the draft's BenchPlan), for the whole speculative rounds (calibration/rounds.py);
the bench `spec@cpu` the target and the draft on the CPU, for the draft's steps timed
inside rounds (grid draft.cpu.timed: in_rounds; calibration/draft_rounds.py).
Only shapes are read here (kestrel_rt.loading.resolve), never weights, and no device is
touched: a plan for a GPU can be made (`kestrel calibrate --dry-run`) on a machine without
one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from calibration.acceptance import AcceptancePlan, acceptance_seconds, plan_acceptance
from calibration.estimate import (
    COLD_COMPILE_S,
    CPU,
    GPU,
    Estimate,
    build_seconds,
    draft_round_seconds,
    overlap_draft_seconds,
    point_seconds,
    spec_round_seconds,
)
from calibration.grid import Grid, Point, expand
from kestrel_sim.errors import ConfigError, KestrelError

DRAFT_DEVICES = {"gpu": ("gpu",), "cpu": ("cpu",), "both": ("gpu", "cpu")}
MIN_REPEATS = 3  # timed runs per point a --max-minutes budget may thin a grid to


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
    peer: str | None = None  # a second GPU: kv_transfer also measured to it (peer_gpu)
    draft_quant: str | None = None  # the draft's projections (int8, int4, int4-last-N)


@dataclass
class BenchPlan:
    name: str  # "target@gpu"
    model: str  # preset or folder, as given
    device: str  # torch device
    dtype: str
    quant: str | None
    shape: object  # ModelShape
    points: list[Point]
    draft: BenchPlan | None = None  # spec@gpu: the draft instance beside the target


@dataclass
class Plan:
    request: Request
    benches: list[BenchPlan]
    estimate: Estimate
    notes: list[str] = field(default_factory=list)  # what the plan leaves out, and why
    acceptance: AcceptancePlan | None = None  # the organic pair's (calibration/acceptance.py)
    target: BenchPlan | None = None  # the target's bench, kept where it measures nothing

    @property
    def target_bench(self) -> BenchPlan:
        """What the fingerprint describes as the target (a plan built by hand: its first)."""
        return self.target or self.benches[0]

    @property
    def points(self) -> list[Point]:
        return [p for b in self.benches for p in b.points]


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
    points = expand(request.grid, target_device, draft_devices(request), request.peer)
    benches = [BenchPlan(f"target@{target_device}", request.model, request.device, dtype,
                         request.quant, shape, [p for p in points if p.model == "target"])]
    check_reach(benches[0].points, shape, f"model {request.model}", request.grid_file)
    if request.draft is not None:
        dshape, dfolder = resolve(request.draft)
        for device in draft_devices(request):
            torch_device = request.device if device == "gpu" else "cpu"
            mine = [p for p in points if p.bench == f"draft@{device}"]
            check_reach(mine, dshape, f"draft {request.draft}", request.grid_file)
            # the draft quantized as --draft-quant says (a scenario's draft.quant), on both
            # devices; on the CPU it takes the CPU's default dtype
            ddtype = (request.dtype if device == "gpu" else None) or plan_dtype(
                dfolder, torch_device)
            benches.append(BenchPlan(f"draft@{device}", request.draft, torch_device, ddtype,
                                     request.draft_quant, dshape, mine))
    pair = [p for p in points if p.model == "pair"]  # overlap: two instances of the target
    if pair:
        check_reach(pair, shape, f"model {request.model}", request.grid_file)
        beside = [p for p in pair if p.decode_model == "draft"]  # and the draft's steps
        draft = next(b for b in benches if b.name == "draft@gpu") if beside else None
        if draft is not None:
            check_reach(beside, draft.shape, f"draft {request.draft}", request.grid_file)
            draft = replace(draft, points=[])
        benches.append(BenchPlan("pair@gpu", request.model, request.device, dtype,
                                 request.quant, shape, pair, draft))
    for device in ("gpu", "cpu"):  # the target and the draft on `device`: whole rounds
        spec = [p for p in points if p.bench == f"spec@{device}"]  # or draft steps in them
        if spec:
            draft = next(b for b in benches if b.name == f"draft@{device}")
            check_reach(spec, shape, f"model {request.model}", request.grid_file)
            check_reach(spec, draft.shape, f"draft {request.draft}", request.grid_file)
            benches.append(BenchPlan(f"spec@{device}", request.model, request.device, dtype,
                                     request.quant, shape, spec, replace(draft, points=[])))
    acceptance = plan_acceptance(request, benches)
    target, benches = benches[0], [b for b in benches if b.points]
    if not benches:
        raise ConfigError(f"grid {request.grid_file} has no point to measure for this model "
                          "(no stage section, or only draft steps without --draft)")
    notes = plan_notes(request) + ([f"also measured: {acceptance.describe()}"]
                                   if acceptance else [])
    return Plan(request, benches, estimate(benches, request.grid, acceptance), notes,
                acceptance, target)


def without_acceptance(plan: Plan, why: str) -> Plan:
    """The plan less its acceptance measurement (its note says `why`), re-estimated."""
    if plan.acceptance is None:
        return plan
    notes = [n for n in plan.notes if not n.startswith("also measured: ")]
    notes.append(f"not measured: {plan.acceptance.describe()} ({why})")
    return replace(plan, notes=notes, acceptance=None,
                   estimate=estimate(plan.benches, plan.request.grid))


def peer_gpu(device: str) -> str | None:
    """The GPU a kv_transfer between GPUs copies to from `device` (cuda:0 -> cuda:1, the
    next one), or None on a machine with fewer than two (or the CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    count = torch.cuda.device_count()
    if count < 2:
        return None
    return f"cuda:{((torch.device(device).index or 0) + 1) % count}"


def plan_notes(request: Request) -> list[str]:
    notes = []
    transfer, gpu = request.grid.kv_transfer, request.device.startswith("cuda")
    if transfer is not None and transfer.between_gpus and request.peer is None and gpu:
        notes.append("kv_transfer between GPUs is skipped: no second GPU to copy to (a run on "
                     "a machine with two measures the link between them)")
    if request.grid.round is not None and request.draft is not None and (
            not gpu or "gpu" not in draft_devices(request)):
        notes.append("round points are skipped: a whole speculative round is measured with "
                     "the target and the draft on a GPU (--device cuda, --draft-device gpu "
                     "or both)")
    return notes


def itemsize(dtype: str) -> int:
    return 4 if "32" in dtype else 2


def speed_and_runs(bp: BenchPlan, timing) -> tuple:
    """(DeviceSpeed, timed + warm-up runs per point) of a bench's model on its device."""
    if bp.device.startswith("cuda"):
        return GPU, timing.warmup + timing.repeats
    return CPU, timing.cpu_warmup + timing.cpu_repeats


def estimate(benches: list[BenchPlan], grid: Grid,
             acceptance: AcceptancePlan | None = None) -> Estimate:
    from kestrel_rt.options import kernel_cache_filled

    t = grid.timing
    out = Estimate({}, {})
    if acceptance is not None:  # its own builds of both models, and its rounds
        out.builds[acceptance.name] = acceptance_seconds(acceptance)
    for b in benches:
        gpu = b.device.startswith("cuda")
        speed, runs = speed_and_runs(b, t)
        size = itemsize(b.dtype)
        graphs = len({(p.batch, p.m) for p in b.points if p.m <= 16}) if gpu else 0
        out.builds[b.name] = build_seconds(b.shape, speed, size, b.quant, graphs)
        if b.name.startswith("pair@"):  # two instances of the model (calibration/overlap.py)
            out.builds[b.name] *= 2
        if b.draft is not None:  # and the draft, its one-token steps' graphs
            d = b.draft
            dspeed, druns = speed_and_runs(d, t)
            mine = [p for p in b.points if p.stage == "round" or p.decode_model == "draft"]
            out.builds[b.name] += build_seconds(d.shape, dspeed, itemsize(d.dtype), d.quant,
                                                len({p.batch for p in mine})
                                                if dspeed is GPU else 0)
        if gpu and not out.compile and not kernel_cache_filled():
            out.compile = COLD_COMPILE_S
            out.builds[b.name] += COLD_COMPILE_S
        for p in b.points:
            if p.stage == "round":
                d = b.draft
                out.points[p.id] = spec_round_seconds(p, b.shape, d.shape, speed, size,
                                                      itemsize(d.dtype), b.quant, runs,
                                                      d.quant)
            elif p.stage == "draft" and b.draft is not None:  # in rounds: draft_rounds.py
                out.points[p.id] = draft_round_seconds(
                    p, b.shape, d.shape, speed, dspeed, size, itemsize(d.dtype), b.quant,
                    d.quant, druns)
            elif p.stage == "overlap" and p.decode_model == "draft":
                d = b.draft
                out.points[p.id] = overlap_draft_seconds(p, b.shape, d.shape, speed, size,
                                                         itemsize(d.dtype), b.quant, runs,
                                                         d.quant)
            else:
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
        thinned = replace(plan, request=request,
                          estimate=estimate(plan.benches, request.grid, plan.acceptance))
        if thinned.estimate.seconds <= 60 * minutes:
            return thinned
    raise ConfigError(
        f"grid {plan.request.grid_file}: estimated {plan.estimate.describe()}, over the "
        f"--max-minutes budget of {minutes:g} even at one warm-up and {MIN_REPEATS} timed "
        "runs per point; use a smaller grid (--grid quick) or a larger budget")
