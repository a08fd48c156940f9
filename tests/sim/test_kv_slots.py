"""Physical KV slots in the simulator, as the runtime has them (kestrel_sim/sim/slots.py,
handover.py): a disaggregated prefill worker holds a slot from admission until the request's
KV has landed, a decode worker from the start of the transfer until the request finishes or
is preempted; transfers wait for a decode slot. Colocated slots never bind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.shape import model_shape
from kestrel_sim.hardware import BUNDLED_DIR
from kestrel_sim.scenario import Scenario
from kestrel_sim.sim.slots import parameter_count, slot_tokens, workspace_bytes

MAX_BATCH = 4


def hardware(tmp_path: Path, free_gb: float) -> str:
    """The bundled H200 with `free_gb` GB free for weights, workspace and KV slots."""
    text = (BUNDLED_DIR / "h200.yaml").read_text().replace(
        "free_memory_gb: 149.6", f"free_memory_gb: {free_gb}")
    path = tmp_path / f"h200-{free_gb}.yaml"
    path.write_text(text)
    return str(path)


def scenario(hw: str, mode: str = "disaggregated", **serving) -> Scenario:
    split = {"prefill_workers": 1, "decode_workers": 1} if mode == "disaggregated" else {}
    return Scenario.load_from_dict({
        "name": "slots", "hardware": hw, "model": "qwen3-0.6b",
        "serving": {"mode": mode, "max_batch": MAX_BATCH, "max_batched_tokens": 2048,
                    "prefill_chunk": 1024, "link": "nvlink", **split, **serving},
        "workload": {"arrivals": {"process": "poisson", "rate": 200.0}, "requests": 60,
                     "prompt_tokens": {"dist": "uniform", "low": 200, "high": 400},
                     "output_tokens": {"dist": "uniform", "low": 40, "high": 80}, "seed": 1},
    })


def tight_gb(sc: Scenario, slots: int) -> float:
    """GB free that hold exactly `slots` slots (and the scratch one) of sc's requests."""
    shape = model_shape(sc.model)
    longest = (sc.workload.prompt_tokens.high + sc.workload.output_tokens.high)
    tokens = slot_tokens(longest, 0, sc.serving.prefill_chunk, sc.serving.max_batched_tokens)
    need = (2 * parameter_count(shape) + workspace_bytes(2 * parameter_count(shape))
            + (slots + 1) * 2 * shape.kv_elements_per_token * tokens)
    return (need + 1e6) / 1e9


def check_complete(run, sc: Scenario) -> None:
    assert run.metrics.completed == sc.workload.requests
    assert all(r.output_tokens == sum(r.emit_counts) for r in run.requests)
    assert [r.output_tokens for r in run.requests] == [
        r.output_tokens for r in run.requests if r.finish is not None]


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals [start, end) open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    return int(np.max(np.cumsum([d for _, d in events])))


@pytest.fixture
def runs(tmp_path):
    """The same disaggregated load with room for the spare slots, and with max_batch only."""
    roomy = scenario(hardware(tmp_path, 149.6))
    tight = scenario(hardware(tmp_path, round(tight_gb(roomy, MAX_BATCH), 3)))
    return roomy, simulate(roomy, trace="full"), tight, simulate(tight, trace="full")


def test_prefill_waits_for_slots_and_loses_nothing(runs):
    roomy, a, tight, b = runs
    assert a.meta["kv_slots_per_worker"] == 2 * MAX_BATCH  # max_batch spare
    assert b.meta["kv_slots_per_worker"] == MAX_BATCH  # no memory for spare slots
    check_complete(a, roomy)
    check_complete(b, tight)
    # a transfer waits while the decode worker's batch holds every slot ...
    assert b.meta["handover_slot_waits"] > a.meta["handover_slot_waits"]
    # ... and the prefill worker waits meanwhile: the first token comes later
    assert b.metrics.median_ttft_ms > 1.5 * a.metrics.median_ttft_ms
    assert b.metrics.median_tpot_ms < a.metrics.median_tpot_ms  # a batch never fuller


def test_no_worker_holds_more_requests_than_slots(runs):
    for _, run in (runs[:2], runs[2:]):
        slots = run.meta["kv_slots_per_worker"]
        moved = {s.requests[0]: s for s in run.spans if s.kind == "kv_transfer"}
        assert len(moved) == len(run.requests)  # every request (all emit > 1 token) went over
        # prefill side: from admission until the KV landed
        held = [(r.prefill_start, moved[r.id].end) for r in run.requests]
        assert most_at_once(held) <= slots
        # decode side: from (at latest) the copy's start until the request finished
        assert most_at_once([(moved[r.id].start, r.finish) for r in run.requests]) <= slots


def test_a_preempted_request_gives_back_its_decode_slot(tmp_path):
    sc = scenario(hardware(tmp_path, 149.6), kv_capacity_tokens=1400, on_kv_full="preempt")
    tight = scenario(hardware(tmp_path, round(tight_gb(sc, MAX_BATCH), 3)),
                     kv_capacity_tokens=1400, on_kv_full="preempt")
    for s in (sc, tight):
        run = simulate(s)  # (the engine asserts every slot came back)
        assert run.meta["preemptions"] > 0
        check_complete(run, s)


def test_transfers_go_to_the_decode_worker_with_the_most_free_slots(tmp_path):
    sc = scenario(hardware(tmp_path, 149.6), prefill_workers=2, decode_workers=2)
    run = simulate(sc, trace="full")
    check_complete(run, sc)
    by = {w: sum(len(s.requests) for s in run.spans if s.kind == "decode" and s.worker == w)
          for w in ("decode0/target", "decode1/target")}
    assert min(by.values()) > 0.3 * max(by.values())  # both share the load


def test_colocated_slots_never_bind(tmp_path):
    """A colocated worker holds a slot only for what it admits (max_batch at most): however
    little memory the hardware has for slots, the run is the same."""
    base = scenario(hardware(tmp_path, 149.6), mode="colocated")
    a = simulate(base, trace="full")
    b = simulate(scenario(hardware(tmp_path, 1.0), mode="colocated"), trace="full")
    assert a.meta["kv_slots_per_worker"] == MAX_BATCH
    assert a.metrics == b.metrics
    assert [(s.start, s.end) for s in a.spans] == [(s.start, s.end) for s in b.spans]
    held = [(r.prefill_start, r.finish) for r in a.requests]
    assert most_at_once(held) <= MAX_BATCH


def test_a_plan_past_the_memory_runs_with_max_batch_slots_and_says_so(tmp_path):
    sc = scenario(hardware(tmp_path, 1.0))  # less than a worker's weights (1.2 GB)
    run = simulate(sc)
    assert run.meta["kv_slots_per_worker"] == MAX_BATCH
    assert run.meta["kv_slots_fit"] is False  # the runtime refuses it
    check_complete(run, sc)


def test_the_workspace_grows_with_the_model():
    from kestrel_sim.sim.slots import WORKSPACE_BYTES, WORKSPACE_MIN_BYTES

    eight = 2 * (parameter_count(model_shape("qwen3-8b")) + parameter_count(model_shape("qwen3-0.6b")))
    assert workspace_bytes(eight) == WORKSPACE_BYTES  # what the H200 runs needed
    assert workspace_bytes(10_000_000) == WORKSPACE_MIN_BYTES  # a tiny test model
    small = 2 * parameter_count(model_shape("qwen3-0.6b"))
    assert WORKSPACE_MIN_BYTES < workspace_bytes(small) < WORKSPACE_BYTES
