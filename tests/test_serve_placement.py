"""Worker placement and the KV hand-over's bookkeeping with several workers, on the CPU.

Placement (kestrel_sim/placement.py, kestrel_rt/serve/placement.py): N prefill and M decode
workers (or N colocated) dealt round-robin over serving.devices, checked against the
machine. The hand-over (kestrel_rt/serve/handover.py) with several prefill and decode
workers on the one CPU device: every request finishes with plain greedy generation's
tokens; a handed-over request is never decoded before its copy landed (transfers delayed
by a Link whose copies happen only when they land, so KV read early would be missing); no
KV slot leaks or is freed twice; one kv_transfer span per hand-over.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_engine import Limits, all_at_once, check_run, scenario

from kestrel_rt.serve import serve
from kestrel_rt.serve.handover import Link, copy_rows
from kestrel_rt.serve.models import build_model
from kestrel_rt.serve.placement import PlacementError, placement
from kestrel_sim.errors import ConfigError
from kestrel_sim.placement import place, worker_prefixes
from kestrel_sim.scenario import Scenario, load_scenario
from kestrel_sim.serving_spec import Serving


@pytest.fixture(scope="module")
def reference(folder):
    return build_model(str(folder), "cpu")


# ---------------------------------------------------------------------------- placement

def disaggregated(p: int, d: int, devices=None) -> Serving:
    return Serving(mode="disaggregated", prefill_workers=p, decode_workers=d, devices=devices)


@given(p=st.integers(1, 6), d=st.integers(1, 6), gpus=st.integers(1, 8),
       colocated=st.booleans())
def test_round_robin_places_every_worker_on_a_listed_device(p, d, gpus, colocated):
    serving = Serving(workers=p) if colocated else disaggregated(p, d)
    names = worker_prefixes(serving)
    assert len(names) == (p if colocated else p + d) == len(set(names))
    devices = [f"cuda:{i}" for i in range(gpus)]
    where = place(names, devices)
    assert list(where) == names  # every worker, in order
    assert all(where[n] == devices[i % gpus] for i, n in enumerate(names))
    counts = [list(where.values()).count(dev) for dev in devices]
    assert max(counts) - min(counts) <= 1  # balanced
    if gpus >= len(names):
        assert len(set(where.values())) == len(names)  # enough GPUs: one each
    # the runtime's default on a machine of `gpus` GPUs is the same placement
    placed = placement(serving, torch.device("cuda"), gpus)
    assert {n: str(dev) for n, dev in placed.items()} == where


def test_two_gpus_split_prefill_and_decode_one_gpu_or_the_cpu_holds_all():
    one_each = disaggregated(1, 1)
    assert {n: str(d) for n, d in placement(one_each, torch.device("cuda"), 2).items()} == {
        "prefill0": "cuda:0", "decode0": "cuda:1"}
    for device, gpus in (("cuda", 1), ("cuda:1", 2), ("cpu", 0)):
        placed = placement(disaggregated(2, 3), torch.device(device), gpus)
        assert set(map(str, placed.values())) == {device if ":" in device or device == "cpu"
                                                  else "cuda:0"}
    explicit = disaggregated(2, 1, ["cuda:1", "cuda:1", "cuda:0"])  # one entry per worker
    assert {n: str(d) for n, d in placement(explicit, torch.device("cuda"), 2).items()} == {
        "prefill0": "cuda:1", "prefill1": "cuda:1", "decode0": "cuda:0"}


def test_refuses_devices_the_machine_lacks():
    with pytest.raises(PlacementError, match=r"serving\.devices names cuda:2 but this machine "
                       r"has 2 GPUs \(cuda:0\.\.cuda:1\)"):
        placement(disaggregated(1, 2, ["cuda:0", "cuda:1", "cuda:2"]), torch.device("cuda"), 2)
    with pytest.raises(PlacementError, match=r"serving\.devices names cuda:1 .* 1 GPU \(cuda:0\)"):
        placement(disaggregated(1, 1, ["cuda:0", "cuda:1"]), torch.device("cuda"), 1)
    with pytest.raises(PlacementError, match=r"serving\.devices names cpu but this run is on "
                       r"the cuda"):
        placement(disaggregated(1, 1, ["cpu"]), torch.device("cuda"), 2)


@pytest.mark.parametrize(("devices", "message"), [
    (["tpu:0"], r"serving\.devices.*unknown device 'tpu:0': expected 'cpu' or 'cuda:N'"),
    (["cuda"], r"serving\.devices.*unknown device 'cuda'"),
    (["cpu", "cuda:0"], r"serving\.devices.*mixes the CPU and GPUs"),
    ([], r"serving\.devices"),
])
def test_the_scenario_refuses_unknown_device_names(tmp_path, devices, message):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "x", "hardware": "h200", "model": "qwen3-0.6b", "workload": {"requests": 2},
        "serving": {"mode": "disaggregated", "devices": devices}}))
    with pytest.raises(ConfigError, match=message):
        load_scenario(path)


def test_the_simulator_runs_a_placed_scenario():
    from kestrel_sim.sim import simulate

    sc = Scenario.load_from_dict({
        "name": "x", "hardware": "h200", "model": "qwen3-0.6b",
        "serving": {"mode": "disaggregated", "prefill_workers": 2, "decode_workers": 1,
                    "devices": ["cuda:0", "cuda:0", "cuda:1"], "link": "nvlink"},
        "workload": {"requests": 20, "arrivals": {"process": "poisson", "rate": 50}}})
    run = simulate(sc, trace="full")
    assert len(run.requests) == 20 and all(r.finish is not None for r in run.requests)
    assert {s.worker for s in run.spans if s.kind == "kv_transfer"} <= {"link0", "link1"}


# ---------------------------------------------------------------------------- hand-over

class SlowLink(Link):
    """A link whose copies take `delay` looks to land, and copy the rows only then: a
    request decoded before its transfer landed would find no KV in its slot."""

    delay = 3

    def enqueue(self, t, n):
        t.rows, t.looks = n, 0
        t.span = self.tracer.open("kv_transfer", self.name, [t.seq.rid], on_device=False,
                                  tokens=n)

    def has_landed(self, t) -> bool:
        t.looks += 1
        if t.looks < self.delay:
            return False
        for src, dst in zip(self.src.models, t.dst.models):
            copy_rows(src.kv, t.src_slot, dst.kv, t.dst_slot, t.rows)
        self.tracer.close(t.span, on_device=False)
        return True


class Arrived(Limits):
    """Limits, and: a decode step's rows all have their KV landed; keeps the engine."""

    def __call__(self, eng, w, plan):
        super().__call__(eng, w, plan)
        self.eng = eng
        if w.role == "decode":
            for seq in plan.rows:
                assert seq.rid not in eng.in_transit, f"request {seq.rid} decoded in transit"
                assert eng.handovers[seq.rid] >= 1


def check_handover(served, eng, sc: Scenario) -> None:
    """Nothing left behind: every slot free, every charge given back, every transfer landed;
    one kv_transfer span per hand-over, on the link of the prefill worker that sent it."""
    for w in eng.workers:
        assert sorted(w.slots.free_slots) == list(range(w.slots.num_slots)), w.name
        assert w.kv.used == 0 and not w.batch and not w.joined and not w.prefilling
    assert not eng.in_transit and not any(link.busy() for link in eng.links)
    assert all(len(q) == 0 for q in eng.decode_queues.values())
    spans = [s for s in served.trace.spans if s.kind == "kv_transfer"]
    per_request = [0] * sc.workload.requests
    for s in spans:
        per_request[s.requests[0]] += 1
    assert per_request == eng.handovers
    assert served.trace.meta["kv_handovers"] == len(spans)
    for rec in served.trace.requests:  # every request of more than one token went over
        assert (eng.handovers[rec.id] >= 1) == (rec.output_tokens > 1)
    assert {s.worker for s in spans} <= {link.name for link in eng.links}


@pytest.mark.parametrize(("p", "d", "policy"), [(2, 2, "wait"), (3, 1, "preempt"),
                                                (1, 3, "wait")])
def test_several_workers_hand_over_every_request_once(folder, reference, p, d, policy):
    sc = scenario(folder, {"mode": "disaggregated", "prefill_workers": p, "decode_workers": d,
                           "max_batch": 2, "max_batched_tokens": 32, "prefill_chunk": 16,
                           "kv_capacity_tokens": 70, "on_kv_full": policy},
                  requests=12, arrivals=all_at_once(12))
    watch = Arrived()
    served = serve(sc, "cpu", observer=watch, threads=False, link_type=SlowLink)
    check_run(served, reference, sc)
    check_handover(served, watch.eng, sc)
    if policy == "wait":  # nothing preempted: exactly one hand-over per request
        assert all(n == (r.output_tokens > 1) for n, r in
                   zip(watch.eng.handovers, served.trace.requests))
    spans = served.trace.spans
    assert {s.worker for s in spans if s.kind == "prefill"} == {
        f"prefill{i}/target" for i in range(p)}
    assert {s.worker for s in spans if s.kind == "decode"} == {
        f"decode{i}/target" for i in range(d)}
    assert {s.worker for s in spans if s.kind == "kv_transfer"} == {
        f"link{i}" for i in range(p)}
    assert served.trace.meta["placement"] == dict.fromkeys(
        [f"prefill{i}" for i in range(p)] + [f"decode{i}" for i in range(d)], "cpu")


def test_the_draft_kv_goes_with_the_target_kv(folder, reference):
    """The draft is the target's own folder (organic greedy acceptance): every proposal is
    accepted only if the draft's KV arrived with the target's."""
    sc = scenario(folder, {"mode": "disaggregated", "prefill_workers": 2, "decode_workers": 2,
                           "max_batch": 2, "max_batched_tokens": 32, "prefill_chunk": 16,
                           "kv_capacity_tokens": 80, "on_kv_full": "wait"},
                  requests=8, output=(4, 16), arrivals=all_at_once(8), k=2)
    watch = Arrived()
    served = serve(sc, "cpu", observer=watch, threads=False, link_type=SlowLink)
    check_run(served, reference, sc)
    check_handover(served, watch.eng, sc)
    stats = served.trace.meta["spec_decode"]
    assert stats["spec_decode_draft_tokens"] > 0
    assert stats["spec_decode_acceptance_rate"] == 100.0


def test_several_colocated_workers_share_the_prefill_queue(folder, reference):
    sc = scenario(folder, {"workers": 3, "max_batch": 2, "kv_capacity_tokens": 80},
                  requests=9, arrivals=all_at_once(9))
    served = serve(sc, "cpu", observer=Limits(), threads=False)
    check_run(served, reference, sc)
    assert {s.worker for s in served.trace.spans if s.kind == "decode"} == {
        "gpu0/target", "gpu1/target", "gpu2/target"}
    assert not [s for s in served.trace.spans if s.kind == "kv_transfer"]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(p=st.integers(1, 3), d=st.integers(1, 3), delay=st.integers(1, 4),
       max_batch=st.integers(1, 3), preempt=st.booleans(), order=st.sampled_from(
           ["fifo", "shortest-first"]), requests=st.integers(2, 8), seed=st.integers(0, 999),
       threads=st.booleans())
def test_any_ratio_of_workers_loses_nothing(folder, reference, p, d, delay, max_batch,
                                            preempt, order, requests, seed, threads):
    sc = scenario(folder, {"mode": "disaggregated", "prefill_workers": p, "decode_workers": d,
                           "max_batch": max_batch, "max_batched_tokens": 24,
                           "prefill_chunk": 8, "kv_capacity_tokens": 60,
                           "on_kv_full": "preempt" if preempt else "wait",
                           "decode_queue": order},
                  requests=requests, prompt=(1, 24), output=(1, 12), seed=seed,
                  arrivals=all_at_once(requests))
    link = type("Slow", (SlowLink,), {"delay": delay})
    watch = Arrived()
    served = serve(sc, "cpu", observer=watch, threads=threads, link_type=link)
    check_run(served, reference, sc)
    check_handover(served, watch.eng, sc)
