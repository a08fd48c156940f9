"""scenarios/validation/: every scenario validates, the suite covers what issue 23 asks for
(item 5), and `kestrel validate --on sim` predicts all of it on this CPU machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kestrel_cli.app import main
from kestrel_sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "scenarios" / "validation"
PATHS = sorted(SUITE.glob("*.yaml"))
LADDER = ["ladder-1-bf16-colocated", "ladder-2-int4", "ladder-3-int4-disaggregated",
          "ladder-4-int4-disaggregated-spec"]


@pytest.fixture(scope="module")
def suite():
    return {p.stem: load_scenario(p) for p in PATHS}


def test_every_scenario_validates_and_is_named_after_its_file(suite):
    assert len(suite) >= 12
    assert all(sc.name == name for name, sc in suite.items())


def test_the_prediction_scenarios_validate():
    """docs/validation.md's predictions name these files (not part of the suite)."""
    names = {load_scenario(p).name for p in sorted((SUITE / "predictions").glob("*.yaml"))}
    assert names == {"k-goodput", "disagg-2gpu", "colocated-2gpu", "disagg-1gpu",
                     "colocated-1gpu"}


def test_the_suite_covers_issue_23(suite):
    scs = list(suite.values())
    spec = [sc for sc in scs if sc.spec is not None]
    assert any(sc.spec is None for sc in scs) and spec
    ks = {sc.spec.k for sc in spec}
    assert min(ks) == 1 and max(ks) >= 8 and len(ks & set(range(1, 9))) >= 4
    assert {sc.spec.correction for sc in spec} == {"separate", "fused"}
    assert {sc.draft.device for sc in spec} == {"cpu", "gpu"}
    assert any(sc.spec.acceptance.per_position for sc in spec)
    assert {sc.serving.mode for sc in scs} == {"colocated", "disaggregated"}
    rates = [sc.workload.arrivals.rate for sc in scs]
    assert min(rates) <= 1 and max(rates) >= 40  # light load and saturation
    assert any(sc.serving.kv_capacity_tokens and sc.serving.on_kv_full == "preempt"
               for sc in scs)
    assert any(sc.model == "qwen3-30b-a3b" for sc in scs)
    assert any(sc.quant == "int4" for sc in scs)
    organic = [sc for sc in spec if sc.spec.acceptance.on_hardware == "organic"]
    assert organic and all(sc.draft.quant != "none" for sc in organic)  # a quantized copy
    held = [sc for sc in scs if sc.validate_.held_out]
    assert held and len(held) < len(scs) and all(sc.validate_.note for sc in held)
    assert set(LADDER) <= set(suite)


def test_every_scenario_runs_on_hardware_as_written(suite):
    """Nothing is left pending: every scenario's keys exist on the runtime (the gaps that
    remain are TODOs in the comments: an int4 profile, the layer-skip draft)."""
    assert not [name for name, sc in suite.items() if sc.validate_.pending]


def test_every_scenario_simulates(suite):
    from kestrel_sim import simulate

    for name, sc in suite.items():
        run = simulate(sc, trace="none")
        assert run.metrics.completed == sc.workload.requests and run.metrics.failed == 0, name
    preempt = simulate(suite["preempt-kv-pressure"], trace="none").metrics
    assert preempt.preemptions > 0  # the KV budget does press


def test_validate_predicts_the_ladder_on_the_simulator(suite, tmp_path, monkeypatch, capsys):
    """`kestrel validate --on sim` (the ladder only, as a chunk: the rest is 'not run')."""
    out = tmp_path / "validation"
    monkeypatch.setattr(sys, "argv", ["kestrel", "validate", str(SUITE), "--on", "sim",
                                      "--out", str(out), "--only", ",".join(LADDER)])
    with pytest.raises(SystemExit) as info:
        main()
    assert (info.value.code or 0) == 0, capsys.readouterr().err
    doc = json.loads((out / "summary.json").read_text())
    assert [e["name"] for e in doc["scenarios"]] == [p.stem for p in PATHS]
    for e in doc["scenarios"]:
        unrun = "pending" if suite[e["name"]].validate_.pending else "not run"
        assert e["status"] == ("predicted" if e["name"] in LADDER else unrun)
        if e["name"] in LADDER:
            assert e["predicted"]["output_throughput"] > 0 and e["predicted"]["p95_e2el_ms"] > 0
    md = (out / "summary.md").read_text()
    ladder = [line.split(" | ")[0].lstrip("| ") for line in md.split("## The deployer's ladder")[1]
              .splitlines() if line.startswith("| ladder-")]
    assert ladder == LADDER


def test_only_takes_names_and_shell_patterns():
    from kestrel_cli.suite import chosen_names
    from kestrel_sim.errors import ConfigError

    names = {p.stem for p in PATHS}
    assert chosen_names("ladder-*", names, SUITE) == set(LADDER)
    assert chosen_names(" spec-off , ladder-1-*", names, SUITE) == {"spec-off", LADDER[0]}
    with pytest.raises(ConfigError, match=r"no scenario named laddr-\* in .*there are: "):
        chosen_names("spec-off,laddr-*", names, SUITE)
