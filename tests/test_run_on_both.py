"""`kestrel run --on hardware|both` and `kestrel validate` end to end on the CPU: the bundled
CPU scenarios (scenarios/hardware/) with a tiny model folder in place of the preset, the
runtime's torch backend measuring and the simulator predicting with the cpu-xeon roofline,
a cost table or a CPU profile. On a CPU the prediction is far off, so the tests hold the
exit status to the tolerances: a tolerance no error can pass fails (exit 1), a generous
one passes (exit 0); the files are written either way."""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from kestrel_cli.app import main
from kestrel_sim.comparison import compare
from kestrel_sim.costs.shape import model_shape, shape_hash
from kestrel_sim.metrics import Metrics
from kestrel_sim.validate_spec import CHECKABLE, Validate

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "scenarios" / "hardware"
# every default check made generous: a CPU run against the roofline passes them
GENEROUS = [f"validate.tolerance_pct.{m}=1e9" for m in Validate().checks()]
TIGHT = ["validate.tolerance_pct.median_tpot_ms=1e-9"]


def kestrel(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["kestrel", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    captured = capsys.readouterr()
    return info.value.code or 0, captured.out, captured.err


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def check_parity_html(text: str, name: str) -> None:
    """Self-contained (plotly.js inline once, nothing fetched) with every section."""
    assert text.startswith("<!DOCTYPE html>") and f"Kestrel parity: {name}" in text
    assert len(re.findall(r"<script[^>]*\bsrc=", text)) == 0  # nothing loaded from outside
    assert text.count("plotly.js v") == 1  # the library embedded once
    for heading in ("Verdict", "Predicted against measured", "Error per metric",
                    "Latency CDFs", "Stage shares", "Timeline, measured", "Timeline, predicted",
                    "Metrics"):
        assert f"<h2>{heading}</h2>" in text
    assert text.count('class="plotly-graph-div"') == 6


def test_on_hardware_writes_a_runs_files(folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "hw"
    code, stdout, err = kestrel(monkeypatch, capsys, "run", CPU / "cpu-colocated.yaml",
                                "--on", "hardware", "--out", out, *sets(f"model={folder}"))
    assert code == 0, err
    assert {"metrics.json", "timeseries.json", "scenario.json", "trace.json",
            "report.html"} <= {p.name for p in out.iterdir()}
    assert "cpu-colocated: measured, CPU" in " ".join(stdout.split())
    m = Metrics.model_validate_json((out / "metrics.json").read_text())
    assert m.completed == 12 and m.failed == 0


def test_on_both_past_a_tolerance_exits_1_and_writes_everything(folder, tmp_path, monkeypatch,
                                                                  capsys):
    out = tmp_path / "both"
    code, stdout, err = kestrel(
        monkeypatch, capsys, "run", CPU / "cpu-spec.yaml", "--on", "both", "--out", out,
        *sets(f"model={folder}", f"draft.model={folder}", *TIGHT))
    assert code == 1, err
    assert "FAIL" in err and "median_tpot_ms" in err
    for side in ("hardware", "sim"):
        m = Metrics.model_validate_json((out / side / "metrics.json").read_text())
        assert m.completed == 10 and m.spec_decode_num_drafts > 0
        assert (out / side / "report.html").is_file()
    doc = json.loads((out / "comparison.json").read_text())
    assert "median_tpot_ms" in doc["failed"] and doc["checks"]["median_tpot_ms"] == 1e-9
    assert doc["acceptance_controlled"] is False  # a model folder: organic acceptance
    assert doc["fingerprint"]["device"].startswith("CPU") and doc["fingerprint"]["torch"]
    rows = {r["metric"]: r for r in doc["rows"]}
    assert set(CHECKABLE) <= set(rows)
    tpot = rows["median_tpot_ms"]
    assert tpot["status"] == "fail" and tpot["measured"] > 0 and tpot["predicted"] > 0
    assert tpot["error_pct"] == pytest.approx(
        (tpot["predicted"] - tpot["measured"]) / tpot["measured"] * 100)
    assert rows["itl_source"]["status"] == "skipped" and rows["itl_source"]["note"]
    assert rows["stage_share[verify]"]["status"] == "info"
    # every measured draft and verify step priced at the shape it ran
    audit = doc["stage_audit"]
    assert {(a["worker"], a["stage"]) for a in audit} >= {("draft", "draft"),
                                                           ("target", "verify")}
    hw = Metrics.model_validate_json((out / "hardware" / "metrics.json").read_text())
    rounds = sum(a["spans"] for a in audit if a["stage"].startswith("verify"))
    assert 0 < rounds <= hw.spec_decode_num_drafts  # one verify per round of >= 1 sequence
    assert all(a["measured_ms"] > 0 and a["priced_ms"] > 0 for a in audit)
    # each worker's traced share of its working time, both sides
    traced = doc["traced"]
    assert set(traced) == {"gpu0", "gpu0/target", "gpu0/cpu-draft"}  # the loop, its workers
    assert traced["gpu0"]["measured"] >= traced["gpu0/target"]["measured"]
    for t in traced.values():
        assert 0.0 < t["measured"] <= 1.0 and (t["predicted"] is None
                                               or 0.0 < t["predicted"] <= 1.0)
    check_parity_html((out / "parity.html").read_text(), "cpu-spec")
    assert "<h2>Measured stages, priced at their shapes</h2>" in (out / "parity.html").read_text()
    table = " ".join(stdout.split())
    assert "median_tpot_ms" in table and "fail" in table and "p95_e2el_ms" in table


def test_on_both_within_tolerance_exits_0_with_a_cost_table(folder, tmp_path, monkeypatch,
                                                            capsys):
    table = "costs={table: {prefill_per_token: 0.05, decode: {1: 2.0, 4: 3.0}}}"
    code, _, err = kestrel(monkeypatch, capsys, "run", CPU / "cpu-colocated.yaml", "--on",
                           "both", "--out", tmp_path / "t", *sets(f"model={folder}", table,
                                                                  *GENEROUS))
    assert code == 0, err
    assert "PASS" in err
    doc = json.loads((tmp_path / "t" / "comparison.json").read_text())
    assert doc["predicted_with"] == "fixed cost table" and doc["failed"] == []
    rows = {r["metric"]: r for r in doc["rows"]}
    assert rows["spec_decode_acceptance_length"]["note"] == (
        "no speculative decoding in the scenario")


def test_on_both_with_a_cpu_profile(folder, tmp_path, monkeypatch, capsys):
    """A CPU scenario's costs may be a profile measured on a CPU (here a small synthetic one
    of the tiny model: decode and prefill rows)."""
    rows = [{"stage": "decode", "batch": b, "tokens_per_seq": 1, "context": c,
             "ms": 0.5 + 0.05 * b + 0.001 * c} for b in (1, 2, 4) for c in (8, 64)]
    rows += [{"stage": "prefill", "batch": b, "tokens_per_seq": p, "context": 0,
              "ms": 0.6 + 0.01 * b * p} for b in (1, 2) for p in (16, 48)]
    profile = tmp_path / "cpu_profile.json"
    profile.write_text(json.dumps({"fingerprint": {
        "device": "CPU (x86_64)", "model": str(folder), "dtype": "float32", "backend": "torch",
        "model_shape_hash": shape_hash(model_shape(str(folder)))}, "measurements": rows}))
    code, _, err = kestrel(monkeypatch, capsys, "run", CPU / "cpu-colocated.yaml", "--on",
                           "both", "--out", tmp_path / "p",
                           *sets(f"model={folder}", f"costs={{profile: {profile}}}", *GENEROUS))
    assert code == 0, err
    doc = json.loads((tmp_path / "p" / "comparison.json").read_text())
    assert doc["predicted_with"].startswith("measured profile cpu_profile.json")


def test_compare_skips_what_cannot_be_compared():
    """Goodput without an SLO and acceptance without a draft are skipped with a note; a
    tolerance on them does not fail."""
    def metrics(scale: float) -> Metrics:
        n = 4
        ttfts = [0.01 * scale * (i + 1) for i in range(n)]
        return Metrics(
            duration=1.0 * scale, completed=n, failed=0, total_input_tokens=40,
            total_output_tokens=40, request_throughput=n / scale, request_goodput=None,
            output_throughput=40 / scale, total_token_throughput=80 / scale,
            max_output_tokens_per_s=40, max_concurrent_requests=2,
            **{f"{s}_{k}_ms": 1.0 * scale for s in ("mean", "median", "std", "p99")
               for k in ("ttft", "tpot", "itl", "e2el")},
            spec_decode_acceptance_rate=None, spec_decode_acceptance_length=None,
            spec_decode_num_drafts=None, spec_decode_draft_tokens=None,
            spec_decode_accepted_tokens=None, spec_decode_per_position_acceptance_rates=[],
            itl_source="exact", worker_utilization={"gpu0/target": 0.5},
            stage_share={"prefill": 0.2, "decode": 0.8}, stage_seconds={}, preemptions=0,
            input_lens=[10] * n, output_lens=[10] * n, ttfts=ttfts, itls=[[]] * n,
            latencies=[t + 0.09 * scale for t in ttfts], start_times=[0.0] * n)

    v = Validate.model_validate({"tolerance_pct": {"request_goodput": 1,
                                                   "spec_decode_acceptance_length": 1}})
    rows = {r.metric: r for r in compare(metrics(1.0), metrics(1.2), v)}
    assert rows["request_goodput"].status == "skipped"
    assert "no SLO" in rows["request_goodput"].note
    assert rows["spec_decode_acceptance_length"].status == "skipped"
    assert rows["median_ttft_ms"].status == "fail"  # +20% past the default 10%
    assert rows["median_ttft_ms"].error_pct == pytest.approx(20.0)
    assert rows["mean_ttft_ms"].status == "info"  # not checked by default
    # p95 from the per-request arrays: TTFTs 10, 20, 30, 40 ms; TPOT 90 ms / 9 tokens
    assert rows["p95_ttft_ms"].measured == pytest.approx(38.5)
    assert rows["p95_tpot_ms"].measured == pytest.approx(10.0)
    assert rows["p95_e2el_ms"].predicted == pytest.approx(1.2 * 38.5 + 108)


def write_suite(tmp_path: Path, folder: Path) -> Path:
    """Two CPU scenarios (one held out) and a pending one, generous tolerances."""
    suite = tmp_path / "suite"
    suite.mkdir()
    generous = {m: 1e9 for m in Validate().checks()}
    for name, held_out in (("cpu-colocated", False), ("cpu-disaggregated", True)):
        data = yaml.safe_load((CPU / f"{name}.yaml").read_text())
        data["model"] = str(folder)
        data["validate"] = {"tolerance_pct": generous, "held_out": held_out}
        (suite / f"{name}.yaml").write_text(yaml.safe_dump(data))
    pending = yaml.safe_load((CPU / "cpu-colocated.yaml").read_text())
    pending |= {"name": "cpu-pending", "model": str(folder),
                "validate": {"pending": "TODO(test): not runnable yet"}}
    (suite / "cpu-pending.yaml").write_text(yaml.safe_dump(pending))
    return suite


def test_validate_runs_a_suite_in_chunks_and_sums_it_up(folder, tmp_path, monkeypatch, capsys):
    suite, out = write_suite(tmp_path, folder), tmp_path / "out"
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", out,
                           "--only", "cpu-colocated")
    assert code == 0, err
    doc = json.loads((out / "summary.json").read_text())
    status = {e["name"]: e["status"] for e in doc["scenarios"]}
    assert status == {"cpu-colocated": "pass", "cpu-disaggregated": "not run",
                      "cpu-pending": "pending"}
    code, stdout, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", out,
                                "--only", "cpu-disaggregated")
    assert code == 0, err
    doc = json.loads((out / "summary.json").read_text())
    status = {e["name"]: e["status"] for e in doc["scenarios"]}
    assert status["cpu-colocated"] == status["cpu-disaggregated"] == "pass"
    medians = doc["median_errors"]
    assert medians["calibration"]["median_tpot_ms"]["scenarios"] == 1
    assert medians["held_out"]["median_tpot_ms"]["scenarios"] == 1
    one = next(e for e in doc["scenarios"] if e["name"] == "cpu-colocated")
    assert medians["calibration"]["median_tpot_ms"]["median_abs_error_pct"] == pytest.approx(
        abs(one["errors"]["median_tpot_ms"]))
    md = (out / "summary.md").read_text()
    assert "## Median absolute error" in md and "| cpu-pending | no | pending |" in md
    assert "Median absolute error" in stdout
    assert (out / "cpu-disaggregated" / "parity.html").is_file()


def test_validate_refuses_a_foreign_out_folder(folder, tmp_path, monkeypatch, capsys):
    suite, out = write_suite(tmp_path, folder), tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", out, "--on", "sim")
    assert code == 2 and "notes.txt" in err


def test_validate_predicts_again_against_kept_measurements(folder, tmp_path, monkeypatch,
                                                           capsys):
    suite, out, again = write_suite(tmp_path, folder), tmp_path / "out", tmp_path / "again"
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", out,
                           "--only", "cpu-colocated")
    assert code == 0, err
    first = json.loads((out / "cpu-colocated" / "comparison.json").read_text())
    # a cost table in place of the roofline: other predictions, the same measurement
    table = "costs={table: {prefill: 5.0, decode: 2.0}}"
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", again,
                           "--measured", out, "--only", "cpu-colocated", *sets(table))
    assert code == 0, err
    doc = json.loads((again / "cpu-colocated" / "comparison.json").read_text())
    was = {r["metric"]: r for r in first["rows"]}
    now = {r["metric"]: r for r in doc["rows"]}
    assert now["median_tpot_ms"]["measured"] == was["median_tpot_ms"]["measured"]
    assert now["median_tpot_ms"]["predicted"] != was["median_tpot_ms"]["predicted"]
    assert doc["fingerprint"] == first["fingerprint"] and doc["measured_at"] == first["date"]
    assert doc["predicted_with"] == "fixed cost table"
    # the kept stages priced again by the table: the same measured times, new prices
    group = ("worker", "stage", "batch", "tokens_per_seq")
    kept = {tuple(a[g] for g in group): a for a in first["stage_audit"]}
    assert len(doc["stage_audit"]) == len(kept) > 0
    for a in doc["stage_audit"]:
        was = kept[tuple(a[g] for g in group)]
        assert a["measured_ms"] == was["measured_ms"]
        if a["stage"] == "decode":
            assert a["priced_ms"] == pytest.approx(2.0)  # the table's decode step
    assert (again / "cpu-colocated" / "hardware" / "metrics.json").is_file()
    assert "<h2>Verdict</h2>" in (again / "cpu-colocated" / "parity.html").read_text()
    # a scenario the runtime would run otherwise is refused, naming what differs
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", tmp_path / "x",
                           "--measured", out, "--only", "cpu-colocated",
                           *sets("workload.requests=3"))
    assert code == 1 and "workload" in err and "measure it again" in err
    # one never measured is recorded as an error, the summary still written
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", tmp_path / "y",
                           "--measured", out, "--only", "cpu-disaggregated")
    assert code == 1 and "holds no measurement" in err
    doc = json.loads((tmp_path / "y" / "summary.json").read_text())
    assert {e["name"]: e["status"] for e in doc["scenarios"]}["cpu-disaggregated"] == "error"
    # without --only, the scenarios KEPT holds no measurement of are passed over
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", tmp_path / "w",
                           "--measured", out)
    assert code == 0, err
    assert "cpu-disaggregated: not measured in" in " ".join(err.split())
    doc = json.loads((tmp_path / "w" / "summary.json").read_text())
    status = {e["name"]: e["status"] for e in doc["scenarios"]}
    assert status["cpu-colocated"] == "pass" and status["cpu-disaggregated"] == "not run"
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", tmp_path / "z",
                           "--measured", out, "--on", "sim")
    assert code == 2 and "--measured" in err


def test_a_suite_keeps_its_measurements_in_one_file_that_predicts_again(folder, tmp_path,
                                                                        monkeypatch, capsys):
    from kestrel_cli.kept import load_kept

    suite, out = write_suite(tmp_path, folder), tmp_path / "out"
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", out,
                           "--only", "cpu-colocated")
    assert code == 0, err
    bundle = out / "measured.json.gz"
    kept = load_kept(bundle)
    assert set(kept) == {"cpu-colocated"} and kept == load_kept(out)  # file and folder agree
    assert kept["cpu-colocated"].metrics["completed"] > 0
    only = tmp_path / "kept" / "measured.json.gz"  # the file alone, as a repository keeps it
    only.parent.mkdir()
    only.write_bytes(bundle.read_bytes())
    plain = tmp_path / "kept" / "measured.json"  # a bundle not compressed reads the same
    plain.write_bytes(gzip.decompress(bundle.read_bytes()))
    assert load_kept(plain) == kept
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", tmp_path / "again",
                           "--measured", only)
    assert code == 0, err
    doc = json.loads((tmp_path / "again" / "cpu-colocated" / "comparison.json").read_text())
    was = json.loads((out / "cpu-colocated" / "comparison.json").read_text())
    assert doc["measured_at"] == was["date"] and doc["fingerprint"] == was["fingerprint"]
    assert load_kept(tmp_path / "again" / "measured.json.gz").keys() == {"cpu-colocated"}
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    code, _, err = kestrel(monkeypatch, capsys, "validate", suite, "--out", tmp_path / "b",
                           "--measured", bad)
    assert code == 2 and "not a bundle" in err


def test_run_predicts_again_against_a_kept_run(folder, tmp_path, monkeypatch, capsys):
    """`kestrel run --on both --measured OUT`: the hardware side is the run kept in OUT (a
    --set variant of a scenario, as the k-goodput prediction's runs are), the prediction is
    today's; OUT itself may be rewritten; other keys than were measured are refused."""
    out = tmp_path / "k2"
    base = [CPU / "cpu-colocated.yaml", "--on", "both", *sets(f"model={folder}", *GENEROUS)]
    code, _, err = kestrel(monkeypatch, capsys, "run", *base, "--out", out)
    assert code == 0, err
    was = json.loads((out / "comparison.json").read_text())
    measured = (out / "hardware" / "metrics.json").read_text()
    table = "costs={table: {prefill_per_token: 0.05, decode: {1: 2.0, 4: 3.0}}}"
    code, _, err = kestrel(monkeypatch, capsys, "run", *base, *sets(table), "--out", out,
                           "--measured", out)
    assert code == 0, err
    doc = json.loads((out / "comparison.json").read_text())
    assert doc["predicted_with"] == "fixed cost table" != was["predicted_with"]
    assert doc["measured_at"] == was["date"] and doc["fingerprint"] == was["fingerprint"]
    assert (out / "hardware" / "metrics.json").read_text() == measured  # kept, not re-run
    code, _, err = kestrel(monkeypatch, capsys, "run", *base, *sets("workload.seed=5"),
                           "--out", tmp_path / "other", "--measured", out)
    assert code == 2 and "workload" in err
    # a bundle of --set variants of one scenario, keyed by label: each found by what it ran
    from kestrel_cli.kept import from_folder, kept_run, load_kept
    code, _, err = kestrel(monkeypatch, capsys, "run", *base, *sets("workload.seed=5"),
                           "--out", tmp_path / "seed5")
    assert code == 0, err
    variants = {"seed0": from_folder(out), "seed5": from_folder(tmp_path / "seed5")}
    bundle = tmp_path / "variants.json.gz"
    bundle.write_bytes(gzip.compress(json.dumps({"scenarios": {
        label: vars(k) for label, k in variants.items()}}).encode()))
    assert load_kept(bundle).keys() == {"seed0", "seed5"}
    for label, kept in variants.items():
        assert kept_run(bundle, kept.scenario) == kept, label
    code, _, err = kestrel(monkeypatch, capsys, "run", CPU / "cpu-colocated.yaml",
                           "--measured", out, "--out", tmp_path / "x")
    assert code == 2 and "--on both" in " ".join(err.split())


def test_controlled_acceptance_is_the_same_on_both_sides(folder, tmp_path, monkeypatch,
                                                         capsys):
    """Each request draws its accepted lengths from its own seeded stream on the runtime and
    in the simulator, so a controlled run's rounds and accepted tokens agree exactly, whatever
    the step times (here the CPU runtime against a roofline of an H200-less CPU)."""
    out = tmp_path / "spec"
    code, _, err = kestrel(monkeypatch, capsys, "run", CPU / "cpu-spec.yaml", "--on", "both",
                           "--out", out, *sets(f"model={folder}", f"draft.model={folder}",
                                               "spec.acceptance.on_hardware=controlled",
                                               *GENEROUS))
    assert code == 0, err
    measured, predicted = (json.loads((out / side / "metrics.json").read_text())
                           for side in ("hardware", "sim"))
    assert measured["acceptance_source"] == "controlled"
    for key in ("spec_decode_num_drafts", "spec_decode_accepted_tokens"):
        assert measured[key] == predicted[key] > 0, key


def test_the_comparison_says_what_lies_between_each_loops_steps(folder, tmp_path,
                                                               monkeypatch, capsys):
    """comparison.json `gaps` (kestrel_sim/gaps.py): per measured serving loop, the time
    between its steps while it had work, by cause; kept as measured by --measured."""
    out = tmp_path / "dis"
    code, _, err = kestrel(monkeypatch, capsys, "run", CPU / "cpu-disaggregated.yaml", "--on",
                           "both", "--out", out, *sets(f"model={folder}", *GENEROUS))
    assert code == 0, err
    gaps = json.loads((out / "comparison.json").read_text())["gaps"]
    assert {"prefill0", "decode0"} <= set(gaps)
    for g in gaps.values():
        assert g["gaps"] >= 0 and g["gap_s"] >= g["none_s"] >= 0.0
    code, _, err = kestrel(monkeypatch, capsys, "run", CPU / "cpu-disaggregated.yaml", "--on",
                           "both", "--out", tmp_path / "again", "--measured", out,
                           *sets(f"model={folder}", *GENEROUS))
    assert code == 0, err
    assert json.loads((tmp_path / "again" / "comparison.json").read_text())["gaps"] == gaps


def test_the_fingerprint_takes_the_commit_it_is_given(monkeypatch):
    """KESTREL_COMMIT names the commit where the tree's .git is older than its files (the GPU
    machine's copy); unset, git says it."""
    from kestrel_cli.compare import git_commit

    monkeypatch.delenv("KESTREL_COMMIT", raising=False)
    found = git_commit()
    assert found is None or len(found.split("+")[0]) == 40
    monkeypatch.setenv("KESTREL_COMMIT", "e261c2b")
    assert git_commit() == "e261c2b"
