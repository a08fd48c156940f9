"""`kestrel run`, `kestrel sweep`, `kestrel schema` end to end on small scenarios."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kestrel_cli.app import app, main
from kestrel_sim.metrics import Metrics, compute_metrics
from kestrel_sim.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "scenarios" / "default.yaml"
SMALL = ["--set", "workload.requests=40"]


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run `kestrel ARGS` through main() as the console script does; (code, out, err)."""
    monkeypatch.setattr(sys, "argv", ["kestrel", *args])
    with pytest.raises(SystemExit) as info:
        main()
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def test_run_writes_every_output(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(DEFAULT), "--out", str(out), "--raw-trace",
                                      *SMALL])
    assert result.exit_code == 0, result.output
    assert "output throughput" in result.output
    metrics = Metrics.model_validate_json((out / "metrics.json").read_text())
    assert metrics.completed == 40
    assert metrics.spec_decode_acceptance_length > 1.0
    trace = json.loads((out / "trace.json").read_text())
    kinds = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"prefill", "draft", "verify"} <= kinds
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "plotly-graph-div" in html
    assert json.loads((out / "scenario.json").read_text())["workload"]["requests"] == 40
    assert len(json.loads((out / "timeseries.json").read_text())["time"]) > 0
    assert not list(out.glob("*.tmp"))
    # the raw Trace reloads, and metrics recomputed from it alone are the same
    raw = Trace.load(out / "kestrel_trace.json")
    assert compute_metrics(raw, {"ttft_ms": 500, "tpot_ms": 50}) == metrics


def test_run_is_deterministic(tmp_path):
    for name in ("a", "b"):
        result = CliRunner().invoke(app, ["run", str(DEFAULT), "-o", str(tmp_path / name), *SMALL])
        assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "metrics.json").read_text() == (
        tmp_path / "b" / "metrics.json"
    ).read_text()


def test_bad_scenario_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEFAULT.read_text().replace("max_batch: 64", "max_bach: 64"))
    out = tmp_path / "out"
    code, _, err = _main(monkeypatch, capsys, "run", str(bad), "--out", str(out))
    assert code == 2
    assert "serving.max_bach: unknown key 'max_bach'" in err
    assert f"{bad}:" in err.replace("\n", "")
    assert "Traceback" not in err
    assert not out.exists()


def test_bad_override_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, _, err = _main(monkeypatch, capsys, "run", str(DEFAULT), "--out", str(out),
                         "--set", "workload.arrivals.rate=-1")
    assert code == 2
    assert "workload.arrivals.rate: must be > 0" in err.replace("\n", " ")
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_out_that_is_a_file_is_refused_before_running(command, tmp_path, monkeypatch, capsys):
    out = tmp_path / "taken"
    out.write_text("keep me")
    grid = ["--set", "spec.k=1,2"] if command == "sweep" else []
    code, _, err = _main(monkeypatch, capsys, command, str(DEFAULT), "--out", str(out),
                         *SMALL, *grid)
    assert code == 2 and "exists and is not a folder" in err and "Traceback" not in err
    assert out.read_text() == "keep me"


@pytest.mark.parametrize("workload,key,line", [
    ("  arrivals: {process: poisson, rate: 1}\n  prompt_tokens: {dist: empirical, file: d.txt}",
     "workload.prompt_tokens.file", 4),
    ("  arrivals: {process: replay, file: d.txt}", "workload.arrivals.file", 3),
])
def test_bad_data_file_content_names_key_and_line(workload, key, line, tmp_path, monkeypatch,
                                                  capsys):
    (tmp_path / "d.txt").write_text("12\nabc\n")
    (tmp_path / "s.yaml").write_text(f"name: s\nworkload:\n{workload}\n")
    out = tmp_path / "out"
    code, _, err = _main(monkeypatch, capsys, "run", str(tmp_path / "s.yaml"), "--out", str(out))
    assert code == 2 and f"s.yaml:{line}: {key}" in err and "d.txt" in err
    assert not out.exists()


def test_bad_acceptance_trace_names_key_and_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "acc.txt").write_text("1 2 2.5\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\ndraft: {model: qwen3-0.6b}\nspec:\n  k: 4\n  acceptance: {trace: acc.txt}\n"
        "workload: {arrivals: {process: poisson, rate: 1}, requests: 3}\n")
    code, _, err = _main(monkeypatch, capsys, "run", str(tmp_path / "s.yaml"),
                         "--out", str(tmp_path / "out"))
    assert code == 2 and "s.yaml:5: spec.acceptance.trace" in err
    assert "acc.txt:1: 2.5 is not a whole number" in err


def test_sweep_grid_in_two_processes(tmp_path):
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, [
        "sweep", str(DEFAULT), *SMALL, "--set", "spec.k=1,4",
        "--set", "workload.arrivals.rate=5,20", "--jobs", "2", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["axes"] == ["spec.k", "workload.arrivals.rate"]
    assert [r["params"] for r in doc["rows"]] == [
        {"spec.k": k, "workload.arrivals.rate": rate} for k in (1, 4) for rate in (5, 20)
    ]
    lengths = {r["params"]["spec.k"]: r["metrics"]["spec_decode_acceptance_length"]
               for r in doc["rows"]}
    assert lengths[4] > lengths[1]  # more drafts, more tokens per round
    assert all(r["metrics"]["completed"] == 40 for r in doc["rows"])
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert len(rows) == 4 and "output_throughput" in rows[0]
    assert "<h2>output_throughput</h2>" in (out / "sweep.html").read_text()


def test_sweep_rejects_a_bad_grid_point_before_running(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    code, _, err = _main(monkeypatch, capsys, "sweep", str(DEFAULT), "--set", "spec.k=2,0",
                         "--out", str(out))
    assert code == 2
    assert "--set spec.k=0: spec.k: must be >= 1" in err.replace("\n", " ")
    assert not out.exists()


def test_sweep_needs_an_axis(monkeypatch, capsys):
    code, _, err = _main(monkeypatch, capsys, "sweep", str(DEFAULT), "--set", "spec.k=2")
    assert code == 2
    assert "at least one --set" in err


def test_schema_is_json_schema():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert {"workload", "spec", "serving"} <= set(schema["properties"])


def test_table_shows_units_overrides_and_the_cost_source(monkeypatch, capsys, tmp_path):
    code, out, err = _main(monkeypatch, capsys, "run", str(DEFAULT), "-o", str(tmp_path / "r"),
                           *SMALL, "--set", "spec.k=2")
    assert code == 0, err
    assert "default: simulated, measured profile qwen3-8b_h200.json" in out
    assert "--set workload.requests=40 --set spec.k=2" in out
    from kestrel_cli.table import COLUMNS

    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in out.splitlines() if line.count("│") == len(COLUMNS) + 1}
    assert rows["TTFT"] == rows["TPOT"] == "ms"
    assert rows["output throughput"] == "tok/s" and rows["duration"] == "s"
    assert rows["draft acceptance rate"] == "%" and rows["acceptance length"] == "tok/round"


def test_a_roofline_result_says_it_is_uncalibrated(monkeypatch, capsys, tmp_path):
    code, out, err = _main(monkeypatch, capsys, "run", str(DEFAULT), "-o", str(tmp_path / "r"),
                           *SMALL, "--set", "costs={roofline: {}}")
    assert code == 0, err
    assert "default: simulated, uncalibrated roofline (h200)" in out


def test_bundled_scenarios_use_the_measured_profile_where_one_exists():
    from kestrel_sim.profile import Profile
    from kestrel_sim.scenario import load_scenario

    measured = {}
    for path in (ROOT / "calibration" / "profiles").glob("*.json"):
        fp = Profile.load(path).fingerprint
        measured[(fp.device.split()[-1].lower(), fp.model)] = path.resolve()
    uncalibrated = []
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        sc = load_scenario(path)
        profile = measured.get((sc.hardware, sc.model))
        if profile is None:
            uncalibrated.append(sc.name)
        else:
            assert sc.costs is not None and sc.costs.profile == str(profile), path.name
    assert uncalibrated == []  # every bundled scenario's model has an H200 profile


def test_progress_bar_with_an_eta_on_a_terminal():
    import io

    from rich.console import Console

    from kestrel_cli.simulate import simulate_with_progress
    from kestrel_sim.scenario import load_scenario

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    trace = simulate_with_progress(load_scenario(DEFAULT, ["workload.requests=200"]), console)
    assert len(trace.requests) == 200
    text = screen.getvalue()
    assert "simulating default" in text and "ETA" in text and "/200" in text


def test_trace_modes_keep_the_metrics(tmp_path, monkeypatch, capsys):
    for mode in ("full", "none"):
        code, _, err = _main(monkeypatch, capsys, "run", str(DEFAULT), "-o", str(tmp_path / mode),
                             *SMALL, "--trace", mode)
        assert code == 0, err
    assert "trace.json" in {p.name for p in (tmp_path / "full").iterdir()}
    assert "trace.json" not in {p.name for p in (tmp_path / "none").iterdir()}
    assert "no trace kept (--trace none)" in " ".join(err.split())
    assert (tmp_path / "full" / "metrics.json").read_text() == (
        tmp_path / "none" / "metrics.json").read_text()
    code, _, err = _main(monkeypatch, capsys, "run", str(DEFAULT), "-o", str(tmp_path / "raw"),
                         *SMALL, "--trace", "none", "--raw-trace")
    assert code == 2 and "--raw-trace" in err and not (tmp_path / "raw").exists()


def test_sweep_rows_hold_no_per_request_arrays(tmp_path):
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, ["sweep", str(DEFAULT), *SMALL, "--set", "spec.k=1,2",
                                      "-j", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "sweep.json").read_text())["rows"][0]["metrics"]
    assert "mean_ttft_ms" in metrics and not {"ttfts", "itls", "input_lens"} & set(metrics)


def test_on_sim_is_the_default(tmp_path, monkeypatch, capsys):
    for name, on in (("default", []), ("sim", ["--on", "sim"])):
        code, _, err = _main(monkeypatch, capsys, "run", str(DEFAULT), "-o", str(tmp_path / name),
                             *SMALL, *on)
        assert code == 0, err
    assert (tmp_path / "default" / "metrics.json").read_text() == (
        tmp_path / "sim" / "metrics.json").read_text()


def test_a_pending_scenario_is_refused_on_hardware_before_anything_runs(tmp_path, monkeypatch,
                                                                         capsys):
    path = tmp_path / "pending.yaml"
    path.write_text(DEFAULT.read_text().replace("../calibration", str(ROOT / "calibration"))
                    + 'validate: {pending: "TODO(x): no key for it yet"}\n')
    for on in ("hardware", "both"):
        out = tmp_path / on
        code, _, err = _main(monkeypatch, capsys, "run", str(path), "--on", on, "--out", str(out))
        assert code == 2 and "validate.pending" in err and "TODO(x)" in err
        assert not out.exists()


def test_a_bad_validate_section_names_key_and_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEFAULT.read_text() + "validate:\n  tolerance_pct: {median_ttft: 5}\n")
    code, _, err = _main(monkeypatch, capsys, "run", str(bad), "--out", str(tmp_path / "o"))
    assert code == 2 and "validate.tolerance_pct.median_ttft: unknown key" in err
    code, _, err = _main(monkeypatch, capsys, "run", str(DEFAULT), "--out", str(tmp_path / "o"),
                         "--set", "validate.tolerance_pct.p99_ttft_ms=0")
    assert code == 2 and "validate.tolerance_pct.p99_ttft_ms: must be > 0" in " ".join(err.split())


def test_the_title_keeps_bracketed_overrides():
    from rich.console import Console

    from kestrel_cli.table import run_title

    console = Console(width=200, record=True)
    console.print(run_title("x", "roofline", ["serving.devices=[cuda:0]"]))
    assert "[cuda:0]" in console.export_text()


def test_run_warns_where_the_runtime_would_refuse_the_kv_slots(tmp_path):
    saturated = ROOT / "scenarios" / "validation" / "disaggregated-saturated.yaml"
    small = ["--set", "workload.requests=80", "--trace", "none"]  # more than max_batch
    result = CliRunner().invoke(app, ["run", str(saturated), "--out", str(tmp_path / "a"),
                                      *small])
    assert result.exit_code == 0, result.output
    assert "would refuse" not in result.output  # 47 slots a worker fit an H200
    # two workers of 64 slots of ~3200 tokens, target and draft, do not fit one H200
    result = CliRunner().invoke(app, ["run", str(saturated), "--out", str(tmp_path / "b"),
                                      "--set", "serving.max_batch=64", *small])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "warning: the runtime would refuse this scenario on h200" in text
    assert "serving.max_batch = 64 slots each" in text
