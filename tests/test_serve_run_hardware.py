"""`kestrel run --on hardware` (kestrel_cli.run_hardware) end to end on the CPU with a tiny
model folder: the bundled CPU scenarios run, and their outputs are the simulator's files,
read by the simulator's own metrics code; keys the runtime cannot honour are refused
naming the key."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console

from kestrel_cli.run_hardware import HardwareMismatchError, notes, run_on_hardware
from kestrel_cli.simulate import render_run
from kestrel_rt.serve.placement import PlacementError
from kestrel_rt.serve.settings import check_lengths
from kestrel_sim.errors import ConfigError
from kestrel_sim.metrics import Metrics, compute_metrics
from kestrel_sim.scenario import Scenario
from kestrel_sim.trace import Trace

HARDWARE_SCENARIOS = sorted((Path(__file__).resolve().parents[1] / "scenarios" / "hardware")
                            .glob("*.yaml"))


def load(path: Path, **changes) -> Scenario:
    data = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return Scenario.load_from_dict(data, base_dir=path.parent)


def quiet() -> tuple[Console, io.StringIO]:
    text = io.StringIO()
    return Console(file=text, width=200), text


def test_the_hardware_scenarios_are_there():
    names = {p.stem for p in HARDWARE_SCENARIOS}
    assert {"cpu-colocated", "cpu-disaggregated", "cpu-closed-loop", "cpu-spec"} <= names
    for path in HARDWARE_SCENARIOS:
        sc = load(path)
        assert sc.name == path.stem and sc.hardware == "cpu-xeon"


@pytest.mark.parametrize("path", HARDWARE_SCENARIOS, ids=lambda p: p.stem)
def test_run_on_hardware_writes_what_the_simulator_reads(folder, tmp_path, path):
    drafts = {"draft__model": str(folder)} if "draft" in yaml.safe_load(path.read_text()) else {}
    sc = load(path, model=str(folder), **drafts)
    console, _ = quiet()
    trace = run_on_hardware(sc, console)
    assert trace.meta["source"] == "hardware" and trace.meta["scenario"] == sc.name
    assert trace.meta["k"] == (sc.spec.k if sc.spec else 0)
    # no CUDA graphs on the CPU; on a GPU, those the warm-up did not foresee
    assert trace.meta["graph_captures_in_run"] == {"count": 0, "seconds": 0.0}
    metrics, files = render_run(sc, trace)
    assert {"metrics.json", "timeseries.json", "trace.json", "report.html"} <= set(files)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    read = Metrics.model_validate_json((tmp_path / "metrics.json").read_text())
    assert read.completed == sc.workload.requests == len(trace.requests)
    assert read.total_output_tokens == sum(r.output_tokens for r in trace.requests)
    assert read.duration > 0 and read.mean_ttft_ms > 0
    assert read.worker_utilization and 0 < max(read.worker_utilization.values()) <= 1
    if sc.spec is not None:  # the draft is the target's folder: what it proposes is kept
        stats = trace.meta["spec_decode"]
        assert stats["spec_decode_accepted_tokens"] == stats["spec_decode_draft_tokens"]
        assert stats["spec_decode_accepted_tokens"] == sum(
            sum(s.accepted) for s in trace.spans if s.kind == "verify")
        assert read.spec_decode_accepted_tokens == stats["spec_decode_accepted_tokens"]
        assert read.spec_decode_acceptance_rate > 50  # per k proposed: fewer near the end
    json.loads((tmp_path / "timeseries.json").read_text())
    json.loads((tmp_path / "trace.json").read_text())
    trace.save(tmp_path / "kestrel_trace.json")  # the Trace itself round-trips
    again = compute_metrics(Trace.load(tmp_path / "kestrel_trace.json"), sc.slo)
    assert again.model_dump() == metrics.model_dump()


def test_runs_several_workers_on_the_one_device(folder):
    path = next(p for p in HARDWARE_SCENARIOS if p.stem == "cpu-disaggregated")
    sc = load(path, model=str(folder), serving__prefill_workers=2, serving__decode_workers=2,
              workload__requests=6)
    trace = run_on_hardware(sc, quiet()[0])
    assert trace.meta["placement"] == {"prefill0": "cpu", "prefill1": "cpu", "decode0": "cpu",
                                       "decode1": "cpu"}
    assert all(r.finish is not None for r in trace.requests)


def test_refuses_devices_the_run_cannot_use(folder):
    sc = load(HARDWARE_SCENARIOS[0], model=str(folder), serving__devices=["cuda:0"])
    with pytest.raises(PlacementError, match=r"serving\.devices names cuda:0 but this run is "
                       r"on the cpu"):
        run_on_hardware(sc, quiet()[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_refuses_gpu_hardware_without_a_gpu(folder):
    sc = load(HARDWARE_SCENARIOS[0], model=str(folder), hardware="h200")
    with pytest.raises(HardwareMismatchError, match="hardware: h200.*no CUDA device"):
        run_on_hardware(sc, quiet()[0])


def test_refuses_requests_longer_than_the_context_or_the_kv_budget():
    check_lengths("m", 200, 52, 4, context=256, capacity=300)  # fits: 256 positions
    with pytest.raises(ConfigError, match="context of 256.*workload.output_tokens"):
        check_lengths("m", 200, 53, 4, context=256, capacity=300)
    with pytest.raises(ConfigError, match="serving.kv_capacity_tokens"):
        check_lengths("m", 200, 52, 4, context=256, capacity=256)


def test_notes_keys_only_the_simulator_uses(folder):
    path = next(p for p in HARDWARE_SCENARIOS if p.stem == "cpu-disaggregated")
    sc = load(path, model=str(folder), serving__link="pcie5", workload__requests=2)
    console, text = quiet()
    run_on_hardware(sc, console)
    assert "serving.link" in text.getvalue()
    assert notes(load(path, model=str(folder))) == []
    spec = next(p for p in HARDWARE_SCENARIOS if p.stem == "cpu-spec")
    said = notes(load(spec, draft__hardware="cpu-xeon", serving__kv_capacity_tokens=None,
                      costs={"roofline": {}}))
    assert [line.split(":")[0] for line in said] == [
        "costs", "draft.hardware", "serving.kv_capacity_tokens is not set"]


def test_serving_reports_progress_and_phases(folder):
    from kestrel_rt.serve import serve

    seen, phases = [], []
    path = next(p for p in HARDWARE_SCENARIOS if p.name == "cpu-colocated.yaml")
    sc = load(path, model=str(folder))
    serve(sc, "cpu", progress=lambda done, total: seen.append((done, total)),
          status=phases.append)
    total = len(seen) and seen[-1][1]
    assert seen and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(phases) == 2 and phases[0].startswith("building")
