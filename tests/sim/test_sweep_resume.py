"""`kestrel sweep` streams each grid point to OUT/points/ as it finishes and resumes from
there (issue 21), without Ray; `--ray` without Ray installed says what to install."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kestrel_main import run_kestrel

from kestrel_cli import sweep
from kestrel_cli.ray_option import with_ray_address
from kestrel_cli.task_store import TaskStore

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "scenarios" / "default.yaml"
GRID = ["--set", "workload.requests=20", "--set", "spec.k=1,2", "--set",
        "workload.arrivals.rate=4,8", "-j", "1"]
REAL_POINT = sweep.simulate_point


def kestrel(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr unwrapped) of `kestrel ARGS`."""
    code, _, err = run_kestrel(monkeypatch, capsys, *args)
    return code, " ".join(err.split())


def counting(calls: list):
    """simulate_point, noting each scenario it runs."""
    def run(scenario):
        calls.append((scenario.spec.k, scenario.workload.arrivals.rate))
        return REAL_POINT(scenario)
    return run


def points(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((out / "points").glob("*.json"))}


def test_each_point_is_a_file_and_a_rerun_recomputes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    assert kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID)[0] == 0
    saved = points(out)
    assert sorted(p["task"] for p in saved.values()) == [
        f"spec.k={k} workload.arrivals.rate={r}" for k in (1, 2) for r in (4, 8)]
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert sorted(json.dumps(r["metrics"]) for r in rows) == sorted(
        json.dumps(p["result"]) for p in saved.values())
    # a marked result on disk is what the rerun reports: read back, not recomputed
    name, marked = next(iter(saved.items()))
    marked["result"]["completed"] = 12345
    (out / "points" / name).write_text(json.dumps(marked))
    calls: list = []
    monkeypatch.setattr(sweep, "simulate_point", counting(calls))
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID)
    assert code == 0, err
    assert calls == []
    assert "resuming: 4 of 4 grid points are already in" in err and "ran 0 of 4" in err
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert sorted(r["metrics"]["completed"] for r in rows) == [20, 20, 20, 12345]


def test_an_interrupted_sweep_keeps_its_points_and_runs_only_the_rest(tmp_path, monkeypatch,
                                                                      capsys):
    out = tmp_path / "new" / "sweep"
    calls: list = []

    def interrupted(scenario):
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the third point
        return counting(calls)(scenario)

    monkeypatch.setattr(sweep, "simulate_point", interrupted)
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID)
    assert code == 130  # as a shell reports SIGINT
    assert len(points(out)) == 2 and not (out / "sweep.json").exists()
    first = calls[:]
    calls.clear()
    monkeypatch.setattr(sweep, "simulate_point", counting(calls))
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID)
    assert code == 0, err
    assert len(calls) == 2 and not set(calls) & set(first)
    assert "ran 2 of 4 scenarios with 1 process and read 2 from" in err
    assert len(json.loads((out / "sweep.json").read_text())["rows"]) == 4


def test_a_grid_extended_runs_only_its_new_points(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    small = ["--set", "workload.requests=20", "--set", "spec.k=1,2", "-j", "1"]
    assert kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *small)[0] == 0
    calls: list = []
    monkeypatch.setattr(sweep, "simulate_point", counting(calls))
    wider = ["--set", "workload.requests=20", "--set", "spec.k=1,2,4", "-j", "1"]
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *wider)
    assert code == 0, err
    assert [k for k, _ in calls] == [4]
    assert [r["params"]["spec.k"] for r in
            json.loads((out / "sweep.json").read_text())["rows"]] == [1, 2, 4]


def test_overwrite_recomputes_every_point(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    assert kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID)[0] == 0
    calls: list = []
    monkeypatch.setattr(sweep, "simulate_point", counting(calls))
    assert kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID,
                   "--overwrite")[0] == 0
    assert len(calls) == 4 and len(points(out)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no staging left


def test_points_of_other_code_are_not_reused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    assert kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID)[0] == 0
    monkeypatch.setattr(sweep, "source_digest", lambda packages: "another version")
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID)
    assert code == 2 and "holds results of other tasks (4 in points/" in err
    assert "kestrel version" in err and "--overwrite" in err


def test_an_unreadable_point_is_run_again(tmp_path):
    store = TaskStore(tmp_path)
    store.save("00aa", {"x": 1.5}, "a")
    store.save("00bb", {"x": 2.5}, "b")
    (tmp_path / "00bb.json").write_text('{"key": "00bb", "res')  # cut short by hand
    assert store.results(["00aa", "00bb", "00cc"]) == {"00aa": {"x": 1.5}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00aa.json", "00bb.json"]


def test_ray_missing_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", tmp_path / "s", *GRID,
                        "--ray")
    assert code == 2 and "kestrel sweep --ray needs Ray" in err
    assert 'pip install "kestrel[ray]"' in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,expected", [
    (["s.yaml", "--ray"], ["s.yaml", "--ray", "local"]),
    (["--ray", "s.yaml", "--set", "k=1,2"], ["--ray", "local", "s.yaml", "--set", "k=1,2"]),
    (["s.yaml", "--ray", "-j", "2"], ["s.yaml", "--ray", "local", "-j", "2"]),
    (["s.yaml", "--ray", "ray://head:10001"], ["s.yaml", "--ray", "ray://head:10001"]),
    (["s.yaml", "--ray", "10.0.0.5:6379"], ["s.yaml", "--ray", "10.0.0.5:6379"]),
    (["s.yaml", "--ray", "auto"], ["s.yaml", "--ray", "auto"]),
    (["s.yaml", "--ray=head:6379"], ["s.yaml", "--ray=head:6379"]),
    (["--", "--ray"], ["--", "--ray"]),
])
def test_a_bare_ray_option_means_a_local_instance(args, expected):
    assert with_ray_address(args) == expected
