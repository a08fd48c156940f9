"""simulate(): build the workers, queues and costs of a Scenario, run SimPy, return a Trace.

All randomness comes from one numpy Generator seeded with workload.seed, drawn in a
fixed order (arrivals, prompt lengths, output lengths up front; then acceptance and any
random service times as the run goes), so a seed reproduces a run exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import simpy

from kestrel_sim.acceptance import build_acceptance
from kestrel_sim.costs.build import build_costs
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import LinkSpec
from kestrel_sim.scenario import Link, Scenario
from kestrel_sim.sim import processes as proc
from kestrel_sim.sim.kv import kv_capacity, kv_transfer_bytes_per_token
from kestrel_sim.sim.state import SimState
from kestrel_sim.sim.steps import StepConfig
from kestrel_sim.sim.worker import Worker
from kestrel_sim.trace import RequestRecord, Trace
from kestrel_sim.workload import draw_workload


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


def simulate(
    scenario: Scenario, progress: Callable[[int, int], None] | None = None
) -> Trace:
    """Run `scenario` on the simulator; progress(done_requests, total) is called as
    requests finish. Every request finishes (KV pressure waits or preempts, never drops)."""
    sc = scenario
    wall0 = time.perf_counter()
    rng = np.random.default_rng(sc.workload.seed)
    drawn = draw_workload(sc.workload, rng)
    costs = build_costs(sc, rng)
    k = sc.spec.k if sc.spec else 0
    acceptance = build_acceptance(sc.spec.acceptance, k) if sc.spec else None
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
    prompts, outputs = drawn.prompt.tolist(), drawn.output.tolist()
    records = [RequestRecord(id=i, arrival=0.0, prompt_tokens=prompts[i],
                             output_tokens=outputs[i]) for i in range(n)]
    env = simpy.Environment()
    st = SimState(env, rng, records, k, reserve, progress)
    cfg = StepConfig(
        costs.target, costs.draft, acceptance,
        separate=bool(sc.spec and sc.spec.correction == "separate"),
        max_batch=sc.serving.max_batch, max_tokens=sc.serving.max_batched_tokens,
        chunk=sc.serving.prefill_chunk, preempt=not wait,
        mixed=sc.serving.mode == "colocated" and sc.serving.prefill_schedule == "mixed",
    )

    roles: dict[str, str] = {}

    def make(prefix: str, role: str) -> Worker:
        dname = None
        if sc.draft is not None:
            dname = f"{prefix}/draft" if sc.draft.device == "gpu" else f"{prefix}/cpu-draft"
            roles[dname] = "draft"
        w = Worker(f"{prefix}/target", role, capacity, dname)
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
        link = _link(sc, hw)
        for i in range(sc.serving.prefill_workers):
            w = make(f"prefill{i}", "prefill")
            w.link = proc.LinkState(f"link{i}", link, per_token)
            roles[w.link.name] = "link"
            st.prefill_workers.append(w)
            env.process(proc.prefill_worker(st, cfg, w))
        for i in range(sc.serving.decode_workers):
            w = make(f"decode{i}", "decode")
            st.decode_workers.append(w)
            env.process(proc.decode_worker(st, cfg, w))
        roles["queue/decode"] = "queue"
    roles["queue/prefill"] = "queue"

    if drawn.arrivals is None:
        proc.closed_loop(st, drawn.concurrency, drawn.think_time_s)
    else:
        env.process(proc.open_arrivals(st, drawn.arrivals))
    env.run(until=st.all_done)
    leaked = {w.name: w.kv.used for w in st.prefill_workers + st.decode_workers if w.kv.used}
    assert not leaked, f"KV accounting leaked tokens: {leaked}"  # every request released its KV
    st.fill_emissions()

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
        "workers": roles,
        "kv_capacity_tokens": capacity,
        "kv_policy": sc.serving.on_kv_full,
        "max_batch": sc.serving.max_batch,
        "preemptions": st.preemptions,
        "requests": n,
        "end_time": env.now,
        "wall_seconds": time.perf_counter() - wall0,
        "slo": sc.slo.model_dump(),
        "scenario_json": sc.model_dump(mode="json"),
    }
    return Trace(spans=st.spans, requests=records, meta=meta)
