"""simulate(): build the workers, queues and costs of a Scenario, run SimPy, return a SimRun:
the run's Trace (all of it, a bounded sample, or no spans and requests: keep.py) with its
metrics and time series, computed by a Recorder that saw every event as the run went.

All randomness comes from one numpy Generator seeded with workload.seed, drawn in a
fixed order (arrivals, prompt lengths, output lengths up front; then any random service
times as the run goes), so a seed reproduces a run exactly. Accepted lengths come from each
request's own Generator (acceptance.accept_rng), as the runtime draws them, or from the
measured sequence it replays (sequence_acceptance.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from kestrel_sim.costs.build import build_costs
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import LinkSpec
from kestrel_sim.metrics import Metrics, metrics_from, with_source
from kestrel_sim.placement import placement
from kestrel_sim.recorder import Recorder
from kestrel_sim.scenario import Link, Scenario, Slo, model_context
from kestrel_sim.sequence_acceptance import request_acceptance
from kestrel_sim.sim import processes as proc
from kestrel_sim.sim.decode_queue import DecodeQueue
from kestrel_sim.sim.device import SharedDevice
from kestrel_sim.sim.handover import Handover, LinkState
from kestrel_sim.sim.keep import TraceKeeper, TraceMode
from kestrel_sim.sim.kv import kv_capacity, kv_transfer_bytes_per_token
from kestrel_sim.sim.slots import simulated_slots
from kestrel_sim.sim.state import SimState
from kestrel_sim.sim.steps import StepConfig
from kestrel_sim.sim.worker import Worker
from kestrel_sim.timeseries import TimeSeries, timeseries_from
from kestrel_sim.trace import Trace
from kestrel_sim.workload import draw_workload


@dataclass(slots=True)
class SimRun(Trace):
    """A simulated run: its Trace (spans, requests, meta, as much as `trace=` kept; meta
    "trace" says what), the Recorder that saw all of it, and the metrics (under the
    scenario's SLO) and time series computed from that Recorder on first use.
    compute_metrics(run, slo) computes them for another SLO."""

    recorder: Recorder | None = None
    slo: Slo | None = None
    _metrics: Metrics | None = field(default=None, repr=False, compare=False)
    _timeseries: TimeSeries | None = field(default=None, repr=False, compare=False)

    @property
    def metrics(self) -> Metrics:
        if self._metrics is None:
            self._metrics = with_source(metrics_from(self.recorder, self.slo), self.meta)
        return self._metrics

    @property
    def timeseries(self) -> TimeSeries:
        if self._timeseries is None:
            self._timeseries = timeseries_from(self.recorder)
        return self._timeseries


def _link(sc: Scenario, hw) -> LinkSpec:
    spec = sc.serving.link
    if isinstance(spec, Link):
        return LinkSpec(bandwidth_gb_s=spec.bandwidth_gb_s, latency_us=spec.latency_us)
    if hw is None:
        raise ConfigError(
            "serving.link is needed: the hardware is a profile of a device with no bundled "
            "description; give {bandwidth_gb_s: ..., latency_us: ...}"
        )
    return hw.link(spec)


def shared_devices(sc: Scenario, env: simpy.Environment, contention) -> dict[str, SharedDevice]:
    """A SharedDevice per device that serving.devices places two workers or more on, by
    worker prefix; a worker alone on its device (or without serving.devices) has none."""
    where = placement(sc.serving)
    if where is None:
        return {}
    out: dict[str, SharedDevice] = {}
    for name in dict.fromkeys(where.values()):
        mine = [w for w, d in where.items() if d == name]
        if len(mine) > 1:
            device = SharedDevice(env, contention)
            out.update(dict.fromkeys(mine, device))
    return out


def simulate(
    scenario: Scenario, progress: Callable[[int, int], None] | None = None,
    trace: TraceMode = "sample",
) -> SimRun:
    """Run `scenario` on the simulator; progress(done_requests, total) is called as
    requests finish. Every request finishes (KV pressure waits or preempts, never drops).
    `trace`: what the returned Trace keeps, "full" (every span and request), "sample"
    (all up to keep.SAMPLE_SPANS spans, then evenly spaced windows of the run) or "none";
    the metrics and time series are the same whichever."""
    sc = scenario
    wall0 = time.perf_counter()
    keeper = TraceKeeper(trace)
    rng = np.random.default_rng(sc.workload.seed)
    contexts = [c for c in (model_context(sc.model),
                            model_context(sc.draft.model) if sc.draft else None) if c]
    drawn = draw_workload(sc.workload, rng, context=min(contexts, default=None))
    costs = build_costs(sc, rng)
    k = sc.spec.k if sc.spec else 0
    capacity = kv_capacity(sc, costs.hardware)
    worst = int((drawn.prompt + drawn.output).max()) + k + 1
    if worst > capacity:
        raise ConfigError(
            f"a request needs {worst} KV tokens (prompt + output + k + 1) but a worker holds "
            f"{capacity} (serving.kv_capacity_tokens): raise it or shorten the requests"
        )
    wait = sc.serving.on_kv_full == "wait"
    reserve = (drawn.prompt + drawn.output + k + 1) if wait else None

    n = drawn.n
    acceptance = (request_acceptance(sc.spec.acceptance, k, sc.workload.seed, n)
                  if sc.spec else None)  # each request's own stream (or measured sequence)
    env = simpy.Environment()
    st = SimState(env, rng, drawn.prompt.tolist(), drawn.output.tolist(), k, reserve, keeper,
                  progress)
    cfg = StepConfig(
        costs.target, costs.draft, acceptance,
        separate=bool(sc.spec and sc.spec.correction == "separate"),
        max_batch=sc.serving.max_batch, max_tokens=sc.serving.max_batched_tokens,
        chunk=sc.serving.prefill_chunk, preempt=not wait,
        mixed=sc.serving.mode == "colocated" and sc.serving.prefill_schedule == "mixed",
        draft_on_device=bool(sc.draft and sc.draft.device == "gpu"),
        round_overhead=costs.round_overhead, catch_up=costs.source != "table",
        decode_overhead=costs.decode_overhead,
    )
    devices = shared_devices(sc, env, costs.contention)
    # physical KV slots per worker, as the runtime plans them (counted where they can bind:
    # disaggregated workers; slots.py)
    slots, slots_fit = simulated_slots(sc, costs.hardware,
                                       int((drawn.prompt + drawn.output).max()), n)
    counted = slots if sc.serving.mode == "disaggregated" else None

    roles: dict[str, str] = {}

    def make(prefix: str, role: str) -> Worker:
        dname = None
        if sc.draft is not None:
            dname = f"{prefix}/draft" if sc.draft.device == "gpu" else f"{prefix}/cpu-draft"
            roles[dname] = "draft"
        w = Worker(f"{prefix}/target", role, capacity, dname, counted)
        w.device = devices.get(prefix)
        roles[w.name] = role
        return w

    if sc.serving.mode == "colocated":
        for i in range(sc.serving.workers):
            w = make(f"gpu{i}", "colocated")
            st.prefill_workers.append(w)
            env.process(proc.colocated_worker(st, cfg, w))
    else:
        hw = costs.hardware
        per_token = kv_transfer_bytes_per_token(sc, hw)
        link = costs.link or _link(sc, hw)  # costs.link: fitted to the profile's transfers
        for i in range(sc.serving.prefill_workers):
            w = make(f"prefill{i}", "prefill")
            w.link = LinkState(f"link{i}", link, per_token)
            roles[w.link.name] = "link"
            st.prefill_workers.append(w)
            env.process(proc.prefill_worker(st, cfg, w))
        for i in range(sc.serving.decode_workers):
            w = make(f"decode{i}", "decode")
            w.queue = DecodeQueue(sc.serving.decode_queue)
            st.decode_workers.append(w)
            env.process(proc.decode_worker(st, cfg, w))
        st.handover = Handover(st, st.decode_workers)
        roles["queue/decode"] = "queue"
    roles["queue/prefill"] = "queue"

    if drawn.arrivals is None:
        proc.closed_loop(st, drawn.concurrency, drawn.think_time_s)
    else:
        env.process(proc.open_arrivals(st, drawn.arrivals))
    env.run(until=st.all_done)
    workers = st.prefill_workers + st.decode_workers
    leaked = {w.name: w.kv.used for w in workers if w.kv.used}
    assert not leaked, f"KV accounting leaked tokens: {leaked}"  # every request released its KV
    held = {w.name: w.slots - w.free_slots for w in workers if w.free_slots != w.slots}
    assert not held, f"KV slots still held: {held}"  # and its slots
    st.flush()
    st.rec.close()

    meta = {
        "name": sc.name,
        "scenario": sc.name,
        "source": "sim",
        "seed": sc.workload.seed,
        "k": k,
        "correction": sc.spec.correction if sc.spec else None,
        "mode": sc.serving.mode,
        "prefill_schedule": sc.serving.prefill_schedule if sc.serving.mode == "colocated" else None,
        "hardware": sc.hardware,
        "model": sc.model,
        "draft": sc.draft.model if sc.draft else None,
        "draft_device": sc.draft.device if sc.draft else None,
        "costs": costs.source,
        "placement": placement(sc.serving),  # None: a device per worker
        "calibrated": costs.source != "roofline",  # roofline: analytic, not measured
        "workers": roles,
        "kv_capacity_tokens": capacity,
        "kv_slots_per_worker": slots,
        "kv_slots_fit": slots_fit,  # False: past the device's memory, the runtime refuses it
        "kv_policy": sc.serving.on_kv_full,
        "max_batch": sc.serving.max_batch,
        "decode_queue": sc.serving.decode_queue,
        "preemptions": st.preemptions,
        "handover_slot_waits": st.handover.slot_waits if st.handover is not None else 0,
        "requests": n,
        "end_time": env.now,
        "slo": sc.slo.model_dump(),
        "scenario_json": sc.model_dump(mode="json"),
        "trace": keeper.meta(),
    }
    run = SimRun(spans=keeper.spans, requests=keeper.requests(st.rec), meta=meta,
                 recorder=st.rec, slo=sc.slo)
    meta["wall_seconds"] = time.perf_counter() - wall0
    return run
