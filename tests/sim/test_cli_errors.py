"""Bad input to `kestrel run` / `kestrel sweep` (issue 25): each case checks the exit
status, the message's key parts, and that nothing is written or lost."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from kestrel_main import run_kestrel

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "scenarios" / "default.yaml"
SMALL = ["--set", "workload.requests=30"]
KV_TOO_SMALL = "serving.kv_capacity_tokens=500"  # fails in simulate(): a request needs ~770


def kestrel(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr unwrapped, rich's error panel drawn out) of `kestrel ARGS`."""
    code, out, err = run_kestrel(monkeypatch, capsys, *args)
    err = err.translate({ord(c): " " for c in "│╭╮╰╯─"})
    return code, out, " ".join(err.split())


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------- item 1: the output folder


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_out_under_a_file_is_refused_before_running(command, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("keep me")
    grid = ["--set", "spec.k=1,2"] if command == "sweep" else []
    code, _, err = kestrel(monkeypatch, capsys, command, DEFAULT, "--out", tmp_path / "file" / "x",
                           *SMALL, *grid)
    assert code == 2 and "file is a file, not a folder" in err and "Traceback" not in err
    assert listing(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "keep me"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_out_in_a_read_only_place_is_refused(command, monkeypatch, capsys):
    grid = ["--set", "spec.k=1,2"] if command == "sweep" else []
    code, out, err = kestrel(monkeypatch, capsys, command, DEFAULT, "--out", "/proc/kestrel-x",
                             *SMALL, *grid)
    assert code == 2 and "--out /proc/kestrel-x: cannot write in /proc" in err
    assert "Traceback" not in err and "completed requests" not in out  # nothing ran


def test_out_with_missing_parents_is_made(tmp_path, monkeypatch, capsys):
    out = tmp_path / "a" / "b" / "run"
    code, _, err = kestrel(monkeypatch, capsys, "run", DEFAULT, "--out", out, *SMALL)
    assert code == 0, err
    assert "metrics.json" in listing(out) and listing(tmp_path / "a" / "b") == ["run"]


def test_a_failing_run_leaves_no_folder_nor_parents(tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "run"
    code, _, err = kestrel(monkeypatch, capsys, "run", DEFAULT, "--out", out, *SMALL,
                           "--set", KV_TOO_SMALL)
    assert code == 2 and "KV tokens" in err
    assert listing(tmp_path) == []  # no run, no staging folder, no parent made for it


def test_a_failing_run_keeps_the_earlier_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert kestrel(monkeypatch, capsys, "run", DEFAULT, "--out", out, *SMALL)[0] == 0
    before = {name: (out / name).read_bytes() for name in listing(out)}
    code, _, _ = kestrel(monkeypatch, capsys, "run", DEFAULT, "--out", out, *SMALL,
                         "--set", KV_TOO_SMALL)
    assert code == 2
    assert {name: (out / name).read_bytes() for name in listing(out)} == before
    assert listing(tmp_path) == ["run"]


def test_an_earlier_run_is_replaced_whole(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert kestrel(monkeypatch, capsys, "run", DEFAULT, "-o", out, *SMALL, "--raw-trace")[0] == 0
    assert "kestrel_trace.json" in listing(out)
    code, _, err = kestrel(monkeypatch, capsys, "run", DEFAULT, "-o", out, *SMALL,
                           "--set", "spec.k=2")
    assert code == 0, err
    assert "kestrel_trace.json" not in listing(out)  # no stale file from the earlier run
    assert json.loads((out / "scenario.json").read_text())["spec"]["k"] == 2
    assert listing(tmp_path) == ["run"]


def test_a_folder_holding_other_files_needs_overwrite(tmp_path, monkeypatch, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = kestrel(monkeypatch, capsys, "run", DEFAULT, "--out", out, *SMALL)
    assert code == 2 and "notes.txt" in err and "--overwrite" in err
    assert listing(out) == ["notes.txt"]
    code, _, err = kestrel(monkeypatch, capsys, "run", DEFAULT, "--out", out, *SMALL,
                           "--overwrite")
    assert code == 0, err
    assert "notes.txt" not in listing(out) and "metrics.json" in listing(out)
    assert listing(tmp_path) == ["mine"]


def test_overwrite_never_replaces_the_working_folder_or_an_input(tmp_path, monkeypatch, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(DEFAULT.read_text().replace("../calibration",
                                                    str(ROOT / "calibration")))
    code, _, err = kestrel(monkeypatch, capsys, "run", scenario, "--out", tmp_path,
                           "--overwrite", *SMALL)
    assert code == 2 and "will not replace a folder that holds" in err
    monkeypatch.chdir(tmp_path)
    code, _, err = kestrel(monkeypatch, capsys, "run", scenario, "--out", ".", "--overwrite",
                           *SMALL)
    assert code == 2 and "will not replace a folder that holds" in err
    assert listing(tmp_path) == ["s.yaml"]


# ---------------------------------------------------------------- item 2: sweep folders, failures


def test_sweep_into_an_existing_folder_needs_overwrite(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    grid = ["--set", "spec.k=1,2", "-j", "1"]
    assert kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *SMALL, *grid)[0] == 0
    before = (out / "sweep.json").read_text()
    code, _, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *SMALL,
                           "--set", "spec.k=3,4", "-j", "1")
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert (out / "sweep.json").read_text() == before
    code, _, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *SMALL,
                           "--set", "spec.k=3,4", "-j", "1", "--overwrite")
    assert code == 0, err
    assert [r["params"]["spec.k"] for r in json.loads((out / "sweep.json").read_text())["rows"]] \
        == [3, 4]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_failing_grid_point_is_named_and_the_others_kept(jobs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    code, _, err = kestrel(
        monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *SMALL, "-j", jobs,
        "--set", "spec.k=1,2", "--set", "serving.kv_capacity_tokens=500,100000")
    assert code == 2
    assert "2 of 4 grid points failed" in err
    assert "grid point spec.k=1 serving.kv_capacity_tokens=500: a request needs" in err
    assert "grid point spec.k=2 serving.kv_capacity_tokens=500:" in err
    assert f"the other 2 points' results are in {out}" in err
    doc = json.loads((out / "sweep.json").read_text())
    assert [r["params"] for r in doc["rows"]] == [
        {"spec.k": 1, "serving.kv_capacity_tokens": 100000},
        {"spec.k": 2, "serving.kv_capacity_tokens": 100000}]
    assert [f["params"]["serving.kv_capacity_tokens"] for f in doc["failed"]] == [500, 500]
    assert len((out / "sweep.csv").read_text().splitlines()) == 3
    assert "ran 2 of 4 scenarios" in err


def test_a_sweep_where_every_point_fails_writes_nothing(tmp_path, monkeypatch, capsys):
    code, _, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", tmp_path / "sweep",
                           *SMALL, "-j", "1", "--set", "spec.k=1,2", "--set", KV_TOO_SMALL)
    assert code == 2 and "2 of 2 grid points failed (nothing was written)" in err
    assert listing(tmp_path) == []


# ---------------------------------------------------------------- item 4: --jobs


@pytest.mark.parametrize("jobs", ["-3", "0"])
def test_sweep_jobs_below_one_is_refused(jobs, tmp_path, monkeypatch, capsys):
    code, _, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", tmp_path / "s",
                           "--set", "spec.k=1,2", "-j", jobs)
    assert code == 2 and "Invalid value for '--jobs'" in err
    assert "greater than or equal to 1" in err
    assert listing(tmp_path) == []


def test_one_process_is_singular(tmp_path, monkeypatch, capsys):
    code, _, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", tmp_path / "s", *SMALL,
                           "--set", "spec.k=1,2", "-j", "1")
    assert code == 0 and "with 1 process;" in err


# ---------------------------------------------------------------- items 3, 5, 6, 7: impossible input


@pytest.mark.parametrize("sets,parts", [
    (["workload.prompt_tokens={dist: fixed, value: 100000}"],
     ["workload:", "100000-token prompt", "qwen3-8b's context holds 40960 tokens"]),
    (["serving.max_batched_tokens=1"],
     ["serving:", "max_batched_tokens is 1", "max_batch = 64 sequences of 5 tokens",
      "320 tokens"]),
    (["workload.requests=1000000000"],
     ["workload.requests:", "1,000,000,000 requests", "at most 10,000,000"]),
])
def test_impossible_scenarios_are_refused(sets, parts, tmp_path, monkeypatch, capsys):
    code, _, err = kestrel(monkeypatch, capsys, "run", DEFAULT, "--out", tmp_path / "r",
                           *(a for s in sets for a in ("--set", s)))
    assert code == 2, err
    for part in parts:
        assert part in err
    assert "Traceback" not in err and listing(tmp_path) == []


def _trace_scenario(tmp_path, acceptance: str) -> Path:
    (tmp_path / "acc.txt").write_text("# accepted lengths\n1 2\n4 9\n")
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\ndraft: {model: qwen3-0.6b}\nspec:\n  k: 4\n"
        f"  acceptance: {acceptance}\n"
        "workload: {arrivals: {process: poisson, rate: 1}, requests: 3}\n")
    return path


def test_acceptance_trace_above_k_is_refused(tmp_path, monkeypatch, capsys):
    path = _trace_scenario(tmp_path, "{trace: acc.txt}")
    code, _, err = kestrel(monkeypatch, capsys, "run", path, "--out", tmp_path / "r")
    assert code == 2
    assert "s.yaml:5: spec.acceptance:" in err and "acc.txt:3: 9 is above 4 (k = 4)" in err
    assert "measured_k" in err and not (tmp_path / "r").exists()


def test_acceptance_trace_measured_at_a_larger_k(tmp_path, monkeypatch, capsys):
    path = _trace_scenario(tmp_path, "{trace: acc.txt, measured_k: 9}")
    code, _, err = kestrel(monkeypatch, capsys, "run", path, "--out", tmp_path / "r")
    assert code == 0, err
    code, _, err = kestrel(monkeypatch, capsys, "run", path, "--out", tmp_path / "r2",
                           "--set", "spec.k=12")
    assert code == 2 and "measured at k = 9" in err and not (tmp_path / "r2").exists()
    path = _trace_scenario(tmp_path, "{trace: acc.txt, measured_k: 8}")
    code, _, err = kestrel(monkeypatch, capsys, "run", path, "--out", tmp_path / "r3")
    assert code == 2 and "acc.txt:3: 9 is above 8 (measured_k = 8)" in err


# ---------------------------------------------------------------- items 8, 9: messages


def _profile_scenario(tmp_path, profile_text: str) -> Path:
    (tmp_path / "p.json").write_text(profile_text)
    path = tmp_path / "s.yaml"
    path.write_text(DEFAULT.read_text().replace("../calibration/profiles/qwen3-8b_h200.json",
                                                "p.json"))
    return path


def test_a_profile_value_that_does_not_validate(tmp_path, monkeypatch, capsys):
    good = json.loads((ROOT / "calibration/profiles/qwen3-8b_h200.json").read_text())
    good["measurements"][3]["ms"] = -1
    del good["fingerprint"]["device"]
    path = _profile_scenario(tmp_path, json.dumps(good, indent=1))
    line = path.read_text().splitlines().index("costs: {profile: p.json}") + 1
    code, _, err = kestrel(monkeypatch, capsys, "run", path, "--out", tmp_path / "r")
    assert code == 2
    assert f"s.yaml:{line}: costs.profile: profile {tmp_path / 'p.json'}" in err
    assert "measurements.3.ms: must be > 0.0 (got -1)" in err
    assert "fingerprint.device: missing required key" in err
    assert "pydantic" not in err and "(got '" not in err and not (tmp_path / "r").exists()


def test_a_profile_that_is_not_json(tmp_path, monkeypatch, capsys):
    path = _profile_scenario(tmp_path, '{\n "fingerprint": {,\n}')
    code, _, err = kestrel(monkeypatch, capsys, "run", path, "--out", tmp_path / "r")
    assert code == 2 and f"{tmp_path / 'p.json'}:2: invalid JSON" in err


@pytest.mark.parametrize("content,line,problem", [
    ("12\n\n# two\n13 abc\n", 4, "'abc' is not a number"),
    ("[12,\n 13,\n true]", 3, "expected a number, got true"),
    ("[12, 13", 1, "invalid JSON"),
    ("5\n0\n", 2, "0 is below 1"),
    ("5\n2.5\n", 2, "2.5 is not a whole number"),
    ("5\nnan\n", 2, "'nan' is not a finite number"),
])
def test_a_bad_empirical_file_names_its_line(content, line, problem, tmp_path, monkeypatch,
                                             capsys):
    (tmp_path / "d.txt").write_text(content)
    (tmp_path / "s.yaml").write_text("name: s\nworkload:\n  arrivals: {process: poisson, "
                                     "rate: 1}\n  prompt_tokens: {dist: empirical, file: d.txt}\n")
    code, _, err = kestrel(monkeypatch, capsys, "run", tmp_path / "s.yaml", "-o", tmp_path / "r")
    assert code == 2
    assert "s.yaml:4: workload.prompt_tokens.file: empirical distribution file " in err
    assert f"d.txt:{line}: {problem}" in err and "(got '" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("content,line,problem", [
    ("arrival,prompt_tokens\n0.1,20\n# gap\n0.2,x\n", 4, "'x' is not a number"),
    ("arrival,prompt_tokens\n0.1,20\n0.2,0\n", 3, "prompt_tokens is 0, expected a whole number"),
    ("arrival,prompt_tokens\n0.1,20\n0.2\n", 3, "1 values, but the header names 2 columns"),
    ("when,prompt_tokens\n0.1,20\n", 1, "the header needs an 'arrival'"),
])
def test_a_bad_replay_file_names_its_line(content, line, problem, tmp_path, monkeypatch, capsys):
    (tmp_path / "a.csv").write_text(content)
    (tmp_path / "s.yaml").write_text("name: s\nworkload:\n  arrivals: {process: replay, "
                                     "file: a.csv}\n")
    code, _, err = kestrel(monkeypatch, capsys, "run", tmp_path / "s.yaml", "-o", tmp_path / "r")
    assert code == 2
    assert "s.yaml:3: workload.arrivals.file: arrival trace file" in err
    assert f"a.csv:{line}: {problem}" in err and "(got '" not in err
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- item 10: help and version


def test_help_shows_the_real_defaults(monkeypatch, capsys):
    _, out, _ = kestrel(monkeypatch, capsys, "run", "--help")
    assert "runs/NAME" in out and "--overwrite" in out
    _, out, _ = kestrel(monkeypatch, capsys, "sweep", "--help")
    assert "runs/NAME-sweep" in out and f"CPU count, {os.cpu_count()}" in out
    assert "[default: 0]" not in out


def test_version_comes_from_the_package_metadata(monkeypatch, capsys):
    from importlib.metadata import version

    code, out, _ = kestrel(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"kestrel {version('kestrel')}"


def test_a_bad_profile_as_the_hardware_names_the_key(tmp_path, monkeypatch, capsys):
    (tmp_path / "p.json").write_text(
        '{"fingerprint": {"device": "NVIDIA H200", "model": "qwen3-8b"}, "measurements": []}')
    (tmp_path / "s.yaml").write_text("name: s\nhardware: p.json\nworkload: {arrivals: "
                                     "{process: poisson, rate: 1}, requests: 5}\n")
    code, _, err = kestrel(monkeypatch, capsys, "run", tmp_path / "s.yaml", "-o", tmp_path / "r")
    assert code == 2
    assert f"s.yaml:2: hardware: profile {tmp_path / 'p.json'} does not validate" in err
    assert "measurements: needs at least 1 entry (got 0)" in err
    assert not (tmp_path / "r").exists()
