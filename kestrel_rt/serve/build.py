"""serve(): a Scenario run on this machine's devices, returned as a kestrel_sim Trace.

    served = serve(scenario, "cpu")            # or "cuda": the machine's GPUs, "cuda:1": one
    served.trace                               # spans + RequestRecords + meta (source hardware)
    served.outputs                             # generated token ids per request

It draws the workload as the simulator does, resolves the serving constants, refuses what
the runtime cannot honour, places the workers on devices (placement.py: serving.devices, or
the machine's GPUs round-robin), builds them (colocated ones; or prefill and decode ones,
each with its own model instances and KV caches on its device; with a draft model when the
scenario speculates), warms them up, and runs the engine in wall-clock time.
"""

from __future__ import annotations

import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import reduce

import torch

from kestrel_rt.loading import default_dtype, resolve
from kestrel_rt.memory import free_bytes
from kestrel_rt.serve.arrivals import Arrivals
from kestrel_rt.serve.engine import ServingEngine
from kestrel_rt.serve.forward import MIXED_FORWARD, chunk_limits, warm_up
from kestrel_rt.serve.handover import Link
from kestrel_rt.serve.models import build_model
from kestrel_rt.serve.placement import placement
from kestrel_rt.serve.requests import Sequence, draw_requests
from kestrel_rt.serve.settings import (
    ServeSettings,
    check_lengths,
    refuse_unsupported,
    serve_settings,
)
from kestrel_rt.serve.speculate import build_decoder, dummy_weights, spec_config
from kestrel_rt.serve.worker import Worker
from kestrel_rt.spec.stats import SpecStats
from kestrel_rt.weights import parse_dtype
from kestrel_sim.scenario import Scenario
from kestrel_sim.sim.slots import device_slots, slot_range, slot_tokens
from kestrel_sim.trace import Trace
from kestrel_sim.workload import DrawnWorkload

ROLES = {"gpu": "colocated", "prefill": "prefill", "decode": "decode"}  # by worker prefix


@dataclass
class Served:
    trace: Trace
    outputs: list[list[int]]  # generated token ids, per request id
    prompts: list[list[int]]  # prompt token ids, per request id


@dataclass
class RunPlan:
    """What a run needs before any model is built."""

    settings: ServeSettings
    drawn: DrawnWorkload
    seqs: list[Sequence]
    max_len: int  # tokens per KV slot
    slots: int  # KV slots per worker
    where: dict[str, torch.device]  # worker prefix -> its device, in placement order
    controlled: bool  # acceptance drawn from spec.acceptance (dummy weights)

    def draft_device(self, sc: Scenario, device: torch.device) -> torch.device:
        """Where a worker on `device` runs its draft: beside its target, or on the CPU."""
        return device if sc.draft.device == "gpu" else torch.device("cpu")


def scenario_hardware(sc: Scenario):
    """The scenario's Hardware description as the simulator loads it (None: a profile of a
    device with no bundled description)."""
    from kestrel_sim.hardware import hardware_for_device, load_hardware
    from kestrel_sim.profile import Profile

    if sc.hardware.endswith(".json"):
        return hardware_for_device(Profile.load(sc.hardware).fingerprint.device)
    return load_hardware(sc.hardware)


def kv_capacity_of(sc: Scenario) -> int:
    """Logical KV tokens per worker: serving.kv_capacity_tokens, or what the simulator
    computes from the hardware's memory (kestrel_sim.sim.kv.kv_capacity)."""
    if sc.serving.kv_capacity_tokens is not None:
        return sc.serving.kv_capacity_tokens
    from kestrel_sim.sim.kv import kv_capacity

    return kv_capacity(sc, scenario_hardware(sc))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, torch {torch.__version__})"


def plan_run(sc: Scenario, where: dict[str, torch.device], dtype,
             controlled: bool | None) -> RunPlan:
    if sc.spec is not None:
        if controlled is None:
            mode = sc.spec.acceptance.on_hardware
            controlled = dummy_weights(sc) if mode == "auto" else mode == "controlled"
        spec_config(sc, controlled)  # refused first if the decoder cannot take it
    shape, folder = resolve(sc.model)
    drawn, seqs = draw_requests(sc.workload, shape.vocab_size)
    capacity = kv_capacity_of(sc)
    s = serve_settings(sc, capacity)
    context = shape.max_position_embeddings
    if sc.draft is not None:
        dshape, dfolder = resolve(sc.draft.model)
        context = min(context, dshape.max_position_embeddings)
    check_lengths(sc.model, int(drawn.prompt.max()), int(drawn.output.max()), s.k, context,
                  capacity)
    # the slots as the simulator plans them (kestrel_sim/sim/slots.py), in the device's
    # free memory rather than the hardware description's
    max_len = slot_tokens(int((drawn.prompt + drawn.output).max()), s.k, s.chunk, s.max_tokens)
    want, least = slot_range(s.mode, s.max_batch, len(seqs))
    slots = want
    for device in dict.fromkeys(where.values()):  # each device: its workers' caches fit
        shapes = [(shape, dtype or default_dtype(folder, device))]
        if sc.draft is not None and sc.draft.device == "gpu":
            shapes.append((dshape, dtype or default_dtype(dfolder, device)))
        sizes = [parse_dtype(dt).itemsize for _, dt in shapes]
        models = [(sh, size, size) for (sh, _), size in zip(shapes, sizes)]
        here = sum(d == device for d in where.values())
        slots = min(slots, device_slots(want, least, here, models, max_len, free_bytes(device)))
    return RunPlan(s, drawn, seqs, max_len, slots, where, bool(sc.spec and controlled))


def build_worker(sc: Scenario, run: RunPlan, prefix: str, role: str, device: torch.device,
                 dtype, status=None) -> Worker:
    """A worker's model instances (target, and the draft when speculating), their KV caches
    and, for a worker that runs rounds, the speculative decoder; warmed up (status(text):
    the CUDA graphs it captures)."""
    models = [build_model(sc.model, device, dtype, sc.quant)]
    draft_name = spec = None
    if sc.draft is not None:
        draft_device = run.draft_device(sc, device)
        models.append(build_model(sc.draft.model, draft_device,
                                  dtype if draft_device == device else None, sc.draft.quant))
        draft_name = f"{prefix}/draft" if sc.draft.device == "gpu" else f"{prefix}/cpu-draft"
    for m in models:
        m.allocate_kv(run.slots, run.max_len)
    if sc.spec is not None and role != "prefill":
        spec = build_decoder(models[0], models[1], spec_config(sc, run.controlled),
                             f"{prefix}/target", draft_name)
    w = Worker(f"{prefix}/target", role, models, run.slots, run.settings.kv_capacity,
               draft_name, spec)
    # the longest chunk, and whether one can start mid-sequence (its prefill graphs then
    # read more keys: each level is captured now, not mid-run)
    longest_chunk, mid = chunk_limits(
        run.settings, max((q.prompt_len for q in run.seqs), default=0),
        max((q.prompt_len + q.output_len for q in run.seqs), default=0))
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        warm_up(w, run.settings.max_batch, run.settings.k, min(longest_chunk, run.max_len), mid,
                status)
    return w


def serve(scenario: Scenario, device: str | torch.device = "cpu", dtype=None, observer=None,
          threads: bool | None = None, controlled: bool | None = None,
          link_type=Link, progress=None, status=None,
          switch_interval_s: float | None = None) -> Served:
    """Run `scenario` on `device` ("cpu", "cuda": the machine's GPUs, "cuda:N"; the workers
    placed by serving.devices); observer(engine, worker, plan) sees every step (tests).
    threads (default: on a GPU) runs several workers in a thread each; controlled (default:
    with dummy weights) draws accepted lengths from spec.acceptance; link_type is the KV
    hand-over's Link class (tests delay transfers with a subclass); progress(finished, total)
    is called as requests finish, status(text) before each phase (the CLI's progress bar);
    switch_interval_s: the GIL's switch interval while threads run (engine.py; None: Python's)."""
    sc = scenario
    wall0 = time.perf_counter()
    refuse_unsupported(sc)
    device = torch.device(device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    run = plan_run(sc, placement(sc.serving, device, gpus), dtype, controlled)
    if status is not None:
        status(f"building and warming {len(run.where)} worker(s): weights, kernels, graphs")
    workers = [build_worker(sc, run, prefix, ROLES[prefix.rstrip("0123456789")], where, dtype,
                            status)
               for prefix, where in run.where.items()]
    if status is not None:
        status(f"serving {len(run.seqs)} requests ({captures(workers)[0]} CUDA graphs warmed)")
    if threads is None:
        threads = any(d.type == "cuda" for d in run.where.values())
    engine = ServingEngine(run.settings, workers, run.seqs, Arrivals(run.drawn), observer,
                           threads, link_type, progress, switch_interval_s)
    warm = captures(workers)
    spans, records = engine.run()
    meta = trace_meta(sc, run, engine, engine.devices[0])
    # CUDA graphs captured while requests were served (shapes the warm-up did not foresee):
    # each stalls its worker for the capture's host time
    count, seconds = (now - then for now, then in zip(captures(workers), warm))
    meta["graph_captures_in_run"] = {"count": count, "seconds": seconds}
    meta["trace"] = {"mode": "full", "complete": True, "spans_seen": len(spans),
                     "spans_kept": len(spans)}
    meta["end_time"] = max(r.finish for r in records) if records else 0.0
    meta["wall_seconds"] = time.perf_counter() - wall0
    return Served(Trace(spans=spans, requests=records, meta=meta),
                  [seq.generated for seq in run.seqs],
                  [seq.tokens[:seq.prompt_len] for seq in run.seqs])


def trace_meta(sc: Scenario, run: RunPlan, engine: ServingEngine, device) -> dict:
    """The simulator's meta keys, for a run on hardware, and what only the runtime knows."""
    s, workers = run.settings, engine.workers
    roles = {}
    for w in workers:
        roles[w.name] = w.role
        if w.draft_name is not None:
            roles[w.draft_name] = "draft"
    roles.update({link.name: "link" for link in engine.links})
    if engine.links:
        roles["queue/decode"] = "queue"
    roles["queue/prefill"] = "queue"
    target = workers[0].target
    return {
        "name": sc.name,
        "scenario": sc.name,
        "source": "hardware",
        "device": device_name(device),
        "placement": {w.name.split("/")[0]: str(w.target.device) for w in workers},
        "backend": type(target.backend).__name__,
        "dtype": str(target.backend.dtype).removeprefix("torch."),
        "seed": sc.workload.seed,
        "k": s.k,
        "correction": sc.spec.correction if sc.spec else None,
        "acceptance_controlled": bool(sc.spec and run.controlled),
        "spec_decode": spec_stats(workers),
        "mode": s.mode,
        "prefill_schedule": sc.serving.prefill_schedule if s.mode == "colocated" else None,
        "mixed_forward": MIXED_FORWARD if s.mixed else None,
        "decode_queue": s.decode_order,
        "threads": engine.threads,
        "hardware": sc.hardware,
        "model": sc.model,
        "draft": sc.draft.model if sc.draft else None,
        "draft_device": sc.draft.device if sc.draft else None,
        "costs": "measured",  # every stage timed on the device (no cost model)
        "workers": roles,
        "kv_capacity_tokens": s.kv_capacity,
        "kv_slots_per_worker": run.slots,
        "kv_policy": sc.serving.on_kv_full,
        "max_batch": s.max_batch,
        "preemptions": engine.preemptions,
        "decode_rounds_ahead": sum(w.rounds_ahead for w in workers),  # serve/ahead.py
        "handover_slot_waits": sum(link.slot_waits for link in engine.links),
        "kv_handovers": sum(engine.handovers),
        "requests": len(run.seqs),
        "slo": sc.slo.model_dump(),
        "scenario_json": sc.model_dump(mode="json"),
    }


def captures(workers) -> tuple[int, float]:
    """CUDA graphs the workers' models have captured so far, and the seconds it took."""
    models = [m for w in workers for m in w.models]
    return (sum(getattr(m, "captures", 0) for m in models),
            sum(getattr(m, "capture_s", 0.0) for m in models))


def spec_stats(workers) -> dict | None:
    """The speculative rounds' statistics over every worker that runs them (or None)."""
    stats = [w.spec.stats for w in workers if w.spec is not None]
    if not stats:
        return None
    return reduce(SpecStats.merged, stats, SpecStats(stats[0].k, stats[0].controlled)).as_dict()
