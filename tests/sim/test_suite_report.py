"""reports/suite.py: summary.html of a validation suite, from summary.json alone; and
`kestrel validate` writing it beside summary.md and summary.json."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kestrel_cli.app import main
from kestrel_cli.suite_summary import HEADLINE, LADDER_PREFIX, TARGETS, Entry, summarize
from reports.suite import (
    HEATMAP_CLIP_PCT,
    PARITY_METRICS,
    heatmap_figure,
    ladder_figure,
    medians_figure,
    parity_figure,
    suite_report,
)

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "scenarios" / "validation"
KEPT = ROOT / "bench" / "results" / "validation"
SECTIONS = ("Suite", "Medians against targets", "Medians, table", "Predicted against measured",
            "Error per scenario and metric", "The deployer's ladder", "To be explained")
DIV = 'class="plotly-graph-div"'


@pytest.fixture(scope="module")
def real() -> dict:
    """The H200 suite's summary as kept in the repository (21 scenarios measured)."""
    return json.loads((KEPT / "summary.json").read_text())


def headings(text: str) -> list[str]:
    return re.findall(r"<h2>(.*?)</h2>", text.replace("&#x27;", "'"))


def check_self_contained(text: str) -> None:
    assert text.startswith("<!DOCTYPE html>")
    assert not re.findall(r"<script[^>]*\bsrc=", text)  # nothing fetched: opens offline
    assert text.count("plotly.js v") <= 1


def test_the_report_of_a_real_suite_has_every_section_and_figure(real):
    text = suite_report(real, "H200 suite")
    check_self_contained(text)
    assert "<title>H200 suite</title>" in text
    assert headings(text) == list(SECTIONS)
    assert text.count(DIV) == 4  # medians, parity, heatmap, ladder
    assert text.count("plotly.js v") == 1
    for name in real["to_explain"]:  # each with its stage-audit lines
        assert f"<b>{name}</b>" in text
        entry = next(e for e in real["scenarios"] if e["name"] == name)
        assert all(g in text for g in entry["gaps"])


def test_the_medians_figure_holds_the_medians_and_the_targets(real):
    fig = medians_figure(real)
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    for group, name in (("calibration", "calibration"), ("held_out", "held out")):
        want = [real["median_errors"][group][m]["median_abs_error_pct"] for m, _ in HEADLINE]
        assert list(bars[name].y) == want
    target = next(t for t in fig.data if t.name == "target")
    labels = dict(HEADLINE)
    assert dict(zip(target.x, target.y)) == {labels[m]: v for m, v in TARGETS.items()}


def test_the_parity_figure_has_one_point_per_measured_scenario(real):
    fig = parity_figure(real)
    compared = [e for e in real["scenarios"] if e["status"] in ("pass", "fail")]
    for i, metric in enumerate(PARITY_METRICS):
        axis = "x" if i == 0 else f"x{i + 1}"
        points = [t for t in fig.data if t.mode == "markers" and t.xaxis == axis]
        xs = sorted(x for t in points for x in t.x)
        assert xs == sorted(e["measured"][metric] for e in compared), metric
        held = next((t for t in points if t.name == "held out"), None)
        assert held is not None and len(held.x) == sum(e["held_out"] for e in compared)
        # hover: the scenario's name and its signed error
        errors = {e["name"]: e["errors"][metric] for e in compared}
        for t in points:
            for s in t.text:
                name = s.split(" (")[0]
                assert f"error {errors[name]:+.1f}%" in s


def test_the_heatmap_clips_the_color_and_prints_the_real_error(real):
    fig = heatmap_figure(real)
    (heat,) = fig.data
    assert len(heat.y) == len(real["scenarios"]) and len(heat.x) == len(HEADLINE)
    for e, zrow, trow in zip(real["scenarios"], heat.z, heat.text):
        for (metric, _), z, text in zip(HEADLINE, zrow, trow):
            err = e["errors"].get(metric) if e["status"] in ("pass", "fail") else None
            if err is None:
                assert z is None and text == ""
            else:
                assert z == pytest.approx(np.clip(err, -HEATMAP_CLIP_PCT, HEATMAP_CLIP_PCT))
                assert text == f"{err:+.1f}%"
    assert heat.zmin == -HEATMAP_CLIP_PCT and heat.zmax == HEATMAP_CLIP_PCT


def test_the_ladder_keeps_its_order_and_both_sides(real):
    fig = ladder_figure(real)
    steps = [e for e in real["scenarios"] if e["name"].startswith(LADDER_PREFIX)]
    measured = [t for t in fig.data if t.name == "measured"]
    assert len(measured) == 3 and len([t for t in fig.data if t.name == "predicted"]) == 3
    assert list(measured[0].x) == [e["name"][len(LADDER_PREFIX):] for e in steps]
    assert list(measured[0].y) == [e["measured"]["output_throughput"] for e in steps]


def predicted_only(names: list[str]) -> dict:
    """A summary with predictions only (--on sim) and every other status."""
    entries = [Entry(n, i % 2 == 1, "predicted",
                     predicted={m: 100.0 * (i + 1) for m, _ in HEADLINE})
               for i, n in enumerate(names)]
    entries += [Entry("never", False, "not run"), Entry("later", False, "pending", "TODO"),
                Entry("crashed", False, "error", "RuntimeError: out of memory")]
    return json.loads(json.dumps(summarize(entries)))


def test_a_suite_with_predictions_only_and_no_ladder_renders():
    text = suite_report(predicted_only(["a", "b"]), "predicted")
    check_self_contained(text)
    assert headings(text) == ["Suite"] and DIV not in text
    assert "None compared with a measurement" in text


def test_a_predicted_ladder_shows_its_predictions_alone():
    doc = predicted_only([f"{LADDER_PREFIX}1-bf16", "x", f"{LADDER_PREFIX}2-int4"])
    text = suite_report(doc, "predicted")
    assert headings(text) == ["Suite", "The deployer's ladder"] and text.count(DIV) == 1
    fig = ladder_figure(doc)
    assert {t.name for t in fig.data} == {"predicted"}
    assert list(fig.data[0].x) == ["1-bf16", "2-int4"]


def validate(monkeypatch, capsys, *args, codes=(0,)) -> None:
    """kestrel validate ARGS exits with one of `codes` (1: a scenario past its tolerance)."""
    monkeypatch.setattr(sys, "argv", ["kestrel", "validate", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    assert (info.value.code or 0) in codes, capsys.readouterr().err


def test_validate_writes_summary_html_on_the_simulator(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    validate(monkeypatch, capsys, SUITE, "--on", "sim", "--out", out,
             "--only", "spec-off,ladder-2-int4")
    text = (out / "summary.html").read_text()
    check_self_contained(text)
    assert f"Validation suite: {SUITE.as_posix()} (predicted)" in text
    assert headings(text) == ["Suite", "The deployer's ladder"] and text.count(DIV) == 1
    # the same OUT takes a later chunk: summary.html is one of the suite's own files
    validate(monkeypatch, capsys, SUITE, "--on", "sim", "--out", out, "--only", "spec-off")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no tmp left


def test_validate_writes_summary_html_against_kept_measurements(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    # exit 1 where a kept run falls past its tolerance with today's profile: still a summary
    validate(monkeypatch, capsys, SUITE, "--out", out, "--measured", KEPT / "measured.json.gz",
             "--only", "spec-off,ladder-2-int4", codes=(0, 1))
    doc = json.loads((out / "summary.json").read_text())
    text = (out / "summary.html").read_text()
    assert [e["status"] in ("pass", "fail") for e in doc["scenarios"]].count(True) == 2
    assert f"Validation suite: {SUITE.as_posix()} (predicted against kept measurements)" in text
    assert headings(text) == list(SECTIONS) and text.count(DIV) == 4
