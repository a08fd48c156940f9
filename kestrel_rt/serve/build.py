"""serve(): a Scenario run on this machine's device, returned as a kestrel_sim Trace.

    served = serve(scenario, "cpu")            # or "cuda"
    served.trace                               # spans + RequestRecords + meta (source hardware)
    served.outputs                             # generated token ids per request

It draws the workload as the simulator does, resolves the serving constants, refuses what
the runtime cannot honour, builds the workers (colocated; or prefill + decode with their
own model instances and KV caches), warms them up, and runs the engine in wall-clock time.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

from kestrel_rt.loading import default_dtype, resolve
from kestrel_rt.memory import free_bytes, kv_bytes
from kestrel_rt.serve.arrivals import Arrivals
from kestrel_rt.serve.engine import ServingEngine
from kestrel_rt.serve.forward import MIXED_FORWARD, warm_up
from kestrel_rt.serve.kv import slots_per_worker
from kestrel_rt.serve.models import build_model
from kestrel_rt.serve.requests import draw_requests
from kestrel_rt.serve.settings import (
    UnsupportedScenarioError,
    check_lengths,
    refuse_unsupported,
    serve_settings,
)
from kestrel_rt.serve.worker import Worker
from kestrel_rt.weights import weight_bytes
from kestrel_sim.scenario import Scenario
from kestrel_sim.trace import Trace

# disaggregated: slots beyond max_batch (per max_batch) for KV in transit and queued, fewer
# where the device's memory cannot hold them
SPARE_SLOTS_PER_BATCH = 1


@dataclass
class Served:
    trace: Trace
    outputs: list[list[int]]  # generated token ids, per request id
    prompts: list[list[int]]  # prompt token ids, per request id


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


def serve(scenario: Scenario, device: str | torch.device = "cpu", dtype=None, observer=None,
          threads: bool | None = None) -> Served:
    """Run `scenario` on `device`; observer(engine, worker, plan) sees every step (tests).
    threads (default: on a GPU) runs a disaggregated run's two workers in two threads."""
    sc = scenario
    wall0 = time.perf_counter()
    refuse_unsupported(sc)
    if sc.spec is not None:
        raise UnsupportedScenarioError(
            "spec: speculative decoding on hardware needs kestrel_rt/spec, which has not "
            "landed yet; remove the draft and spec keys or run on the simulator (--on sim)")
    device = torch.device(device)
    shape, folder = resolve(sc.model)
    drawn, seqs = draw_requests(sc.workload, shape.vocab_size)
    capacity = kv_capacity_of(sc)
    s = serve_settings(sc, capacity)
    check_lengths(sc.model, int(drawn.prompt.max()), int(drawn.output.max()), s.k,
                  shape.max_position_embeddings, capacity)
    longest = int((drawn.prompt + drawn.output).max())
    # + the widest padded chunk: a padded row writes K/V past its own tokens (the packed
    # forward will not need this)
    max_len = longest + s.k + 1 + min(s.chunk, s.max_tokens, longest)
    n = len(seqs)
    roles_n = 1 if s.mode == "colocated" else 2
    want = min(s.max_batch if roles_n == 1 else s.max_batch * (1 + SPARE_SLOTS_PER_BATCH), n)
    dt = dtype or default_dtype(folder, device)
    slots = slots_per_worker(want, min(s.max_batch, n), roles_n,
                             kv_bytes(shape, dt, max_len), roles_n * weight_bytes(shape, dt),
                             free_bytes(device), max_len)

    def worker(name: str, role: str, slots: int) -> Worker:
        models = [build_model(sc.model, device, dtype)]
        for m in models:
            m.allocate_kv(slots, max_len)
        w = Worker(name, role, models, slots, capacity)
        warm_up(w, s.max_batch)
        return w

    if s.mode == "colocated":
        workers = [worker("gpu0/target", "colocated", slots)]
        roles = {"gpu0/target": "colocated"}
    else:
        workers = [worker("prefill0/target", "prefill", slots),
                   worker("decode0/target", "decode", slots)]
        roles = {"prefill0/target": "prefill", "link0": "link", "decode0/target": "decode",
                 "queue/decode": "queue"}
    roles["queue/prefill"] = "queue"
    engine = ServingEngine(s, workers, seqs, Arrivals(drawn), device, observer,
                           threads=device.type == "cuda" if threads is None else threads)
    spans, records = engine.run()
    meta = {
        "name": sc.name,
        "scenario": sc.name,
        "source": "hardware",
        "device": device_name(device),
        "backend": type(workers[0].target.backend).__name__,
        "dtype": str(workers[0].target.backend.dtype).removeprefix("torch."),
        "seed": sc.workload.seed,
        "k": s.k,
        "correction": None,
        "acceptance_controlled": False,
        "mode": s.mode,
        "prefill_schedule": sc.serving.prefill_schedule if s.mode == "colocated" else None,
        "mixed_forward": MIXED_FORWARD if s.mixed else None,
        "decode_queue": s.decode_order,
        "threads": engine.threads,
        "hardware": sc.hardware,
        "model": sc.model,
        "draft": None,
        "draft_device": None,
        "costs": "measured",  # every stage timed on the device (no cost model)
        "workers": roles,
        "kv_capacity_tokens": capacity,
        "kv_policy": sc.serving.on_kv_full,
        "max_batch": s.max_batch,
        "preemptions": engine.preemptions,
        "handover_slot_waits": engine.link.slot_waits if engine.link else 0,
        "requests": n,
        "trace": {"mode": "full", "complete": True, "spans_seen": len(spans),
                  "spans_kept": len(spans)},
        "end_time": max(r.finish for r in records) if records else 0.0,
        "wall_seconds": time.perf_counter() - wall0,
        "slo": sc.slo.model_dump(),
        "scenario_json": sc.model_dump(mode="json"),
    }
    trace = Trace(spans=spans, requests=records, meta=meta)
    return Served(trace, [seq.generated for seq in seqs],
                  [seq.tokens[:seq.prompt_len] for seq in seqs])
