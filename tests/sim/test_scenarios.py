"""Every bundled scenario validates, and so does every command its comments suggest."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kestrel_cli.sweep import grid_points, parse_axes
from kestrel_sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))


def _commands(path: Path) -> list[list[str]]:
    """`kestrel run|sweep ...` lines in the file's comments, split like a shell would."""
    found = []
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").strip()
        if text.startswith("kestrel "):
            found.append(shlex.split(text))
    return found


def test_the_issue_set_is_present():
    names = {p.stem for p in SCENARIOS}
    assert {"default", "nospec", "spec-k4-separate", "spec-k4-fused", "draft-gpu", "draft-cpu",
            "colocated", "disaggregated", "qwen3-30b-a3b"} <= names


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_validates(path):
    scenario = load_scenario(path)
    assert scenario.name == path.stem  # runs/<name> then matches the file


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_commented_commands_validate(path):
    for argv in _commands(path):
        assert argv[1] in ("run", "sweep")
        target = ROOT / argv[2]  # a scenario in the repo (this one or its counterpart)
        assert target.resolve() in SCENARIOS
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        if argv[1] == "run":
            load_scenario(target, sets)
            continue
        fixed, axes = parse_axes(sets)
        assert axes, f"{path.name}: a sweep without an axis"
        for point in grid_points(axes):
            load_scenario(target, [*fixed, *(f"{k}={v}" for k, v in point.items())])


def test_pairs_differ_only_where_they_say():
    def load(name):
        return load_scenario(ROOT / "scenarios" / f"{name}.yaml").model_dump()

    sep, fused = load("spec-k4-separate"), load("spec-k4-fused")
    assert sep["spec"]["correction"] == "separate" and fused["spec"]["correction"] == "fused"
    assert sep["workload"] == fused["workload"] == load("nospec")["workload"]
    gpu, cpu = load("draft-gpu"), load("draft-cpu")
    assert (gpu["draft"]["device"], cpu["draft"]["device"]) == ("gpu", "cpu")
    assert gpu["workload"] == cpu["workload"]
    col, dis = load("colocated"), load("disaggregated")
    assert (col["serving"]["mode"], dis["serving"]["mode"]) == ("colocated", "disaggregated")
    assert col["workload"] == dis["workload"]
