"""A measured run's CUDA graphs captured mid-run (trace meta graph_captures_in_run: each
stalled a worker) reach comparison.json, and the suite summary names the scenarios whose
runs captured any."""

from __future__ import annotations

import json
from pathlib import Path

from kestrel_cli.compare import comparison_doc
from kestrel_cli.suite_summary import entry_of, markdown, summarize
from kestrel_sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "scenarios" / "validation"


def test_comparison_json_holds_the_runs_captures():
    sc = load_scenario(VALIDATION / "light-load-mixed-lengths.yaml")
    captured = {"count": 2, "seconds": 0.21}
    doc = comparison_doc(sc, [], {"device": "NVIDIA H200", "graph_captures_in_run": captured},
                         "profile")
    assert json.loads(json.dumps(doc))["graph_captures_in_run"] == captured
    assert comparison_doc(sc, [], {"device": "CPU"}, "roofline")["graph_captures_in_run"] is None


def write(folder: Path, captured: dict | None) -> None:
    folder.mkdir(parents=True)
    doc = {"rows": [{"metric": "median_tpot_ms", "measured": 10.0, "predicted": 11.0,
                     "error_pct": 10.0}], "failed": []}
    if captured is not None:
        doc["graph_captures_in_run"] = captured
    (folder / "comparison.json").write_text(json.dumps(doc))


def test_the_summary_names_a_run_that_captured_graphs(tmp_path):
    names = stalled, clean = ["light-load-mixed-lengths", "spec-off"]
    scenarios = {n: load_scenario(VALIDATION / f"{n}.yaml") for n in names}
    write(tmp_path / stalled, {"count": 3, "seconds": 0.314})
    write(tmp_path / clean, {"count": 0, "seconds": 0.0})
    entries = [entry_of(scenarios[n], tmp_path / n) for n in names]
    assert entries[0].graph_captures_in_run == {"count": 3, "seconds": 0.314}
    text = markdown(json.loads(json.dumps(summarize(entries))), "suite")
    line = next(ln for ln in text.splitlines() if ln.startswith("CUDA graphs captured mid-run"))
    assert f"{stalled} (3, 0.31 s)" in line and clean not in line
    # none captured, or an older comparison.json that does not say: no such line
    write(tmp_path / "old" / clean, None)
    quiet = [entry_of(scenarios[clean], tmp_path / clean),
             entry_of(scenarios[clean], tmp_path / "old" / clean)]
    assert quiet[1].graph_captures_in_run is None
    assert "captured mid-run" not in markdown(summarize(quiet), "suite")
