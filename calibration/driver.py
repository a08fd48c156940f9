"""The calibration run: build each bench of a plan, time its points, and hand back what was
measured and what failed.

    plan = make_plan(request)                  # calibration/plan.py
    outcome = run(plan, reporter)              # records, failures (point id -> why)
    profile = to_profile(outcome.records, fingerprint(plan))   # calibration/record.py

Benches (model instances: the target, the draft on the GPU, the draft on the CPU) run one
after the other, each built (weights, quantization, backend), prepared (KV cache sized to its
points, kernels compiled, graphs captured), measured point by point, then freed. A point that
fails is recorded with its id and the run goes on; a bench that cannot be built fails all its
points. `run_bench` is the unit a later multi-GPU driver (Ray) would hand to a worker: one
bench and its points, alone; `fingerprint` depends on the plan only, so the Profiles of parts
measured apart merge (Profile.merge).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from calibration.grid import Grid, Point
from calibration.plan import BenchPlan, Plan

ROTATION = 2  # KV slots per row a bench keeps where memory allows (rows rotate over them)
KV_MEMORY_SHARE = 0.6  # of the free GPU memory after a build, at most, for KV slots
SKIPPED = "skipped: the --max-minutes budget was spent"


@dataclass
class Outcome:
    records: list = field(default_factory=list)  # calibration.measure.Record
    failures: dict[str, str] = field(default_factory=dict)  # point id -> why
    seconds: float = 0.0
    acceptance: object | None = None  # kestrel_sim MeasuredAcceptance (calibration/acceptance.py)


def kv_layout(bp: BenchPlan, model, prefill_buckets: tuple[int, ...]) -> tuple[int, int]:
    """(slots, tokens per slot) of the bench's KV cache: room for every step point (a
    one-sequence prefill chunk padded to its graph bucket), and spare slots for the rows to
    rotate over where the GPU has the memory."""
    steps = [p for p in bp.points if p.stage != "kv_transfer"]
    if not steps:
        return 1, 16

    def reach(p: Point) -> int:
        if p.prompt_chunk and p.batch == 1:
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


def bench_options(bp: BenchPlan):
    """The RuntimeOptions a bench's model is built with: the device's defaults."""
    from kestrel_rt.options import default_options

    return default_options(bp.device, bp.shape, bp.quant)


def build_bench(bp: BenchPlan, grid: Grid):
    """The bench's model, built and prepared, owning its KV slots (the overlap bench
    `pair@gpu`: two instances of it, calibration/overlap.py; the round bench `spec@gpu`:
    the target and the draft, calibration/rounds.py)."""
    import torch

    if bp.name.startswith("pair@"):
        from calibration.overlap import build_pair

        return build_pair(bp, grid)
    if bp.name.startswith("spec@"):
        from calibration.rounds import build_spec

        return build_spec(bp, grid)

    from calibration.measure import Bench, transfer_caches
    from kestrel_rt.runner import build_model, prepare

    options = bench_options(bp)
    model = build_model(bp.model, bp.device, bp.dtype, bp.quant, options, seed=0)
    slots, max_len = kv_layout(bp, model, tuple(getattr(model, "prefill_buckets", ())))
    graphable = [p for p in bp.points if p.stage in ("decode", "verify", "correction", "draft")]
    batches = tuple(sorted({p.batch for p in graphable})) or (1,)
    new_tokens = sorted({p.m for p in graphable if not p.catch_up}
                        | {p.after_k + 1 for p in graphable if p.after_k})
    prefill = sorted({p.m for p in bp.points if p.prompt_chunk and p.batch == 1})
    prepare(model, slots, max_len, batches, tuple(new_tokens) or (1,),
            prefill=tuple(n for n in prefill if n < max_len) or (min(32, max_len - 1),))
    kv = model.kv
    gpu = model.device.type == "cuda"
    t = grid.timing
    bench = Bench(bp.name, model, [kv.allocate() for _ in range(slots)],
                  t.warmup if gpu else t.cpu_warmup, t.repeats if gpu else t.cpu_repeats)
    warm_catch_up(bench, [p for p in graphable if p.catch_up])
    biggest = max((p.m for p in bp.points if p.stage == "kv_transfer" and not p.peer),
                  default=0)
    if biggest:
        bench.transfers[""] = transfer_caches(model, biggest)
    if gpu:
        torch.cuda.synchronize(model.device)
    return bench


def warm_catch_up(bench, points: list[Point]) -> None:
    """Capture the graphs of the draft's catch-up steps (M > 1, last_only: keyed apart from
    the decode graphs prepare() captures) on the bench's own slots, left empty after, so
    that no point's runs capture one (its warm-up runs would, but a graph's capture is no
    part of a step)."""
    from calibration.measure import set_lengths

    if not hasattr(bench.model, "graphs"):  # eager (no GraphModel): nothing to capture
        return
    for b, m in sorted({(p.batch, p.m) for p in points}):
        slots = bench.slots[:b]
        bench.model.forward(bench.tokens(b, m), slots, [m] * b, last_only=True, greedy=True)
        set_lengths(bench.model.kv, slots, 0)


def release(device: str) -> None:
    """A finished bench's memory back to the device (kestrel_rt/memory.py reclaim)."""
    if device.startswith("cuda"):
        import torch

        from kestrel_rt.memory import reclaim

        reclaim(torch.device(device))
    else:
        gc.collect()


def describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


class Silent:
    """A run_bench reporter that says nothing (a Ray worker: progress is reported per part,
    by the driver)."""

    def building(self, bp) -> None: ...
    def built(self, bp, error) -> None: ...
    def measuring(self, point) -> None: ...
    def measured(self, point, record, error) -> None: ...
    def measuring_acceptance(self, plan) -> None: ...
    def measured_acceptance(self, plan, block, error) -> None: ...


def run_bench(bp: BenchPlan, grid: Grid, outcome: Outcome, reporter,
              deadline: float | None = None) -> None:
    """Build one bench and time its points into `outcome` (failures by point id)."""
    from calibration.measure import measure

    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    def skip(p: Point) -> None:
        outcome.failures[p.id] = SKIPPED
        reporter.measured(p, None, SKIPPED)

    if late():  # no model is built past the deadline
        for p in bp.points:
            skip(p)
        return
    reporter.building(bp)
    try:
        bench = build_bench(bp, grid)
    except Exception as err:  # noqa: BLE001 - a bench that cannot be built fails its points
        why = f"building {bp.name} ({bp.model}) failed: {describe(err)}"
        for p in bp.points:
            outcome.failures[p.id] = why
        reporter.built(bp, why)
        release(bp.device)
        return
    reporter.built(bp, None)
    try:
        for p in bp.points:
            if late():
                skip(p)
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
    if plan.acceptance is not None:  # the organic pair's acceptance, as served
        from calibration.acceptance import measure_planned

        measure_planned(plan.acceptance, outcome, reporter, deadline)
    outcome.seconds = time.monotonic() - t0
    return outcome


def model_name(model: str) -> str:
    """The Fingerprint's `model`: a preset's name as given, a folder as its absolute path
    (which the simulator can read the shape from on this machine)."""
    from kestrel_rt.loading import looks_like_path

    return str(Path(model).expanduser().resolve()) if looks_like_path(model) else model


def fingerprint(plan: Plan) -> dict:
    """The Profile fingerprint's fields for this run, from the plan alone (so that parts of
    one plan measured apart fingerprint alike and merge). `options`: per bench, its dtype,
    quant and RuntimeOptions; draft_quant: the draft's (--draft-quant), the same on every
    draft bench. With the draft on both devices draft_device says gpu; each Measurement
    names its own device. The target's fields are its bench's also where the grid gives it
    no point (a part measured for `kestrel calibrate --update`)."""
    import torch

    from calibration.fingerprint import environment, git_commit
    from kestrel_sim.costs.shape import shape_hash

    req, target = plan.request, plan.target_bench
    drafts = [b for b in plan.benches if b.name.startswith("draft@")]
    # a draft measured only beside its target (its steps timed inside rounds: spec@cpu)
    beside = {b.draft.name: b.draft for b in plan.benches if b.draft is not None}
    drafts += [d for name, d in beside.items() if name not in {b.name for b in drafts}]
    options = {b.name: {"dtype": b.dtype, "quant": b.quant or "none",
                        **bench_options(b).model_dump(mode="json")}
               for b in plan.benches + drafts}
    mine = bench_options(target)  # the target's, also where it measured nothing
    backend = mine.backend + ("+graphs" if mine.graphs else "")
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
        "draft_quant": req.draft_quant or "none",
        "draft_device": drafts[0].name.split("@")[1] if drafts else None,
        "backend": backend,
        "options": options,
        "grid": req.grid_name,
    }
