"""Every scenario meant for one H200 (the validation suite and the predictions to be tested on
it) fits one: its workers' weights and KV caches (one row of the longest request per slot)
within what an idle H200 reports free. The runtime refuses a run that does not fit only once
it is on the GPU; this finds it on the CPU, before device time is spent (three validation
scenarios were once refused on the H200). And the simulator plans the same KV slots per
worker as the runtime does there (kestrel_sim/sim/slots.py), from the hardware description's
free memory."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kestrel_rt.serve import build
from kestrel_rt.serve.placement import placement
from kestrel_rt.weights import weight_bytes
from kestrel_sim import simulate
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import PRESETS, preset
from kestrel_sim.scenario import load_scenario
from kestrel_sim.sim.slots import parameter_count

ROOT = Path(__file__).resolve().parents[1] / "scenarios" / "validation"
# bytes torch.cuda.mem_get_info reported free on an idle H200 (2026-12-02), as the hardware
# description gives the simulator
H200_FREE = load_hardware("h200").free_memory_gb * 1e9
ONE_GPU = [p for p in sorted(ROOT.glob("*.yaml")) + sorted(ROOT.glob("predictions/*1gpu.yaml"))
           + [ROOT / "predictions" / "k-goodput.yaml"]]


def on_h200(monkeypatch) -> None:
    """plan_run as on an idle H200, from a CPU-only torch: its free memory, and a preset's
    dtype on CUDA (bfloat16)."""
    monkeypatch.setattr(build, "free_bytes", lambda device: int(H200_FREE))
    monkeypatch.setattr(build, "default_dtype", lambda folder, device: "bfloat16")


def planned(path, monkeypatch):
    """(scenario, plan_run's plan on an idle H200); skips a scenario for other hardware.
    plan_run raises KestrelError when the scenario does not fit."""
    sc = load_scenario(path, [])
    if sc.hardware != "h200":
        pytest.skip(f"{path.name} is for {sc.hardware}")
    on_h200(monkeypatch)
    return sc, build.plan_run(sc, placement(sc.serving, torch.device("cuda"), 1), None, None)


@pytest.mark.parametrize("path", ONE_GPU, ids=lambda p: p.stem)
def test_the_scenario_fits_one_h200(path, monkeypatch):
    sc, run = planned(path, monkeypatch)
    assert run.slots >= min(sc.serving.max_batch, len(run.seqs))


def test_the_check_refuses_what_does_not_fit(monkeypatch):
    from kestrel_sim.errors import KestrelError

    sc = load_scenario(ROOT / "disaggregated-saturated.yaml", ["serving.max_batch=64"])
    on_h200(monkeypatch)
    with pytest.raises(KestrelError, match="serving.max_batch = 64"):
        build.plan_run(sc, placement(sc.serving, torch.device("cuda"), 1), None, None)


@pytest.mark.parametrize("path", ONE_GPU, ids=lambda p: p.stem)
def test_the_simulator_plans_the_slots_the_runtime_plans(path, monkeypatch):
    sc, run = planned(path, monkeypatch)
    meta = simulate(sc, trace="none").meta
    assert meta["kv_slots_per_worker"] == run.slots
    assert meta["kv_slots_fit"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_slot_plan_counts_the_weights_the_runtime_loads(name):
    shape = preset(name)
    assert 2 * parameter_count(shape) == weight_bytes(shape, "bfloat16")
