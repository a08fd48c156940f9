"""The summary of a validation suite (`kestrel validate`): one row per scenario, median
absolute errors per metric over the calibration scenarios and, apart, over the held-out
ones, the scenarios past 10% (to be explained), and the deployer's ladder.

Built from the suite's output folder alone, so a suite run in several chunks (`--only`)
sums up to one table: OUT/NAME/comparison.json (a scenario run on both) or
OUT/NAME/metrics.json (predicted only, --on sim).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kestrel_sim.comparison import value_of
from kestrel_sim.metrics import Metrics
from kestrel_sim.scenario import Scenario

# the summary's columns and the suite's targets, shared with reports/suite.py
from kestrel_sim.validate_spec import EXPLAIN_PCT, HEADLINE, LADDER_PREFIX, TARGETS


@dataclass
class Entry:
    name: str
    held_out: bool
    status: str  # pass | fail | predicted | pending | error | not run
    note: str = ""
    measured: dict[str, float | None] = field(default_factory=dict)
    predicted: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, float | None] = field(default_factory=dict)  # percent
    failed: list[str] = field(default_factory=list)
    # the measured stages the costs price furthest off (comparison.json's stage_audit)
    gaps: list[str] = field(default_factory=list)
    # CUDA graphs the measured run captured mid-run: {"count", "seconds"} (None: not said)
    graph_captures_in_run: dict | None = None


def entry_of(sc: Scenario, folder: Path, problem: str | None = None) -> Entry:
    """What OUT/NAME holds for scenario `sc` (problem: the error of a run that failed)."""
    v = sc.validate_
    e = Entry(sc.name, v.held_out, "not run", v.note or "")
    if problem is not None:
        e.status, e.note = "error", problem
    elif (folder / "comparison.json").is_file():
        doc = json.loads((folder / "comparison.json").read_text())
        rows = {r["metric"]: r for r in doc["rows"]}
        for metric, _ in HEADLINE:
            row = rows.get(metric, {})
            e.measured[metric], e.predicted[metric] = row.get("measured"), row.get("predicted")
            e.errors[metric] = row.get("error_pct")
        e.failed = doc["failed"]
        e.status = "fail" if e.failed else "pass"
        e.gaps = stage_gaps(doc.get("stage_audit") or [])
        e.graph_captures_in_run = doc.get("graph_captures_in_run")
    elif (folder / "metrics.json").is_file():
        m = Metrics.model_validate_json((folder / "metrics.json").read_text())
        e.predicted = {metric: value_of(m, metric) for metric, _ in HEADLINE}
        e.status = "predicted"
    elif v.pending:
        e.status, e.note = "pending", v.pending.strip()
    return e


def stage_gaps(audit: list[dict], most: int = 3) -> list[str]:
    """The stages whose priced time in all is furthest from the measured, in seconds:
    "draft prefill on the draft: -73% (0.606 s measured)"."""
    from kestrel_sim.stage_audit import totals

    rows = sorted(totals(audit), key=lambda t: -abs(t["priced_s"] - t["measured_s"]))
    return [f"{t['stage']} on the {t['worker']}: {_err(t['error_pct'])} "
            f"({t['measured_s']:.3g} s measured)" for t in rows[:most]
            if t["error_pct"] is not None and abs(t["error_pct"]) >= 1.0]


def median_errors(entries: list[Entry]) -> dict[str, tuple[float | None, int]]:
    """metric -> (median absolute error in percent, scenarios counted)."""
    out = {}
    for metric, _ in HEADLINE:
        errs = [abs(e.errors[metric]) for e in entries if e.errors.get(metric) is not None]
        out[metric] = (float(np.median(errs)) if errs else None, len(errs))
    return out


def summarize(entries: list[Entry]) -> dict:
    compared = [e for e in entries if e.status in ("pass", "fail")]
    groups = {"calibration": [e for e in compared if not e.held_out],
              "held_out": [e for e in compared if e.held_out]}
    medians = {g: {m: {"median_abs_error_pct": v, "scenarios": n}
                   for m, (v, n) in median_errors(es).items()} for g, es in groups.items()}
    explain = [e.name for e in compared
               if any(err is not None and abs(err) > EXPLAIN_PCT
                      for metric, err in e.errors.items() if metric != "duration")]
    return {"targets_pct": TARGETS, "explain_past_pct": EXPLAIN_PCT, "median_errors": medians,
            "to_explain": explain, "scenarios": [e.__dict__ for e in entries]}


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _err(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def markdown(doc: dict, title: str) -> str:
    entries = [Entry(**e) for e in doc["scenarios"]]
    lines = [f"# {title}", ""]
    compared = any(e.status in ("pass", "fail") for e in entries)
    if compared:
        lines += ["## Median absolute error", "",
                  "| metric | target | calibration | held out |", "| --- | ---: | ---: | ---: |"]
        for metric, label in HEADLINE:
            cells = []
            for group in ("calibration", "held_out"):
                cell = doc["median_errors"][group][metric]
                v, n = cell["median_abs_error_pct"], cell["scenarios"]
                cells.append("-" if v is None else f"{v:.1f}% (n={n})")
            target = TARGETS.get(metric)
            lines.append(f"| {label} | {'-' if target is None else f'{target:g}%'} | "
                         f"{cells[0]} | {cells[1]} |")
        lines += ["", f"Past {EXPLAIN_PCT:g}% on a headline metric (to be explained): "
                  + (", ".join(doc["to_explain"]) or "none"), ""]
        gaps = [e for e in entries if e.name in doc["to_explain"] and e.gaps]
        if gaps:
            lines += [("Where their measured stages and the costs differ most (each stage "
                       "priced at the shapes it ran; kestrel_sim/stage_audit.py):"), ""]
            lines += [f"- {e.name}: " + "; ".join(e.gaps) for e in gaps] + [""]
    lines += ["## Scenarios", "", "| scenario | held out | status | "
              + " | ".join(label for _, label in HEADLINE) + " |",
              "| --- | --- | --- | " + " | ".join("---:" for _ in HEADLINE) + " |"]
    for e in entries:
        cells = []
        for metric, _ in HEADLINE:
            pred = _num(e.predicted.get(metric))
            if e.status in ("pass", "fail"):
                cells.append(f"{_num(e.measured.get(metric))} / {pred} "
                             f"({_err(e.errors.get(metric))})")
            else:
                cells.append(pred)
        lines.append(f"| {e.name} | {'yes' if e.held_out else 'no'} | {e.status} | "
                     + " | ".join(cells) + " |")
    if compared:
        lines += ["", "Cells: measured / predicted (error)."]
        stalled = [f"{e.name} ({c['count']}, {c['seconds']:.2f} s)" for e in entries
                   if (c := e.graph_captures_in_run) and c.get("count")]
        if stalled:
            lines += ["", "CUDA graphs captured mid-run (each stalled a worker, inside the "
                      "measured times): " + ", ".join(stalled) + "."]
    ladder = [e for e in entries if e.name.startswith(LADDER_PREFIX)]
    if ladder:
        lines += ["", "## The deployer's ladder", "",
                  "| step | status | output tok/s | E2EL p95 ms | TTFT p95 ms |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for e in ladder:
            cells = []
            for metric in ("output_throughput", "p95_e2el_ms", "p95_ttft_ms"):
                pred = _num(e.predicted.get(metric))
                cells.append(f"{_num(e.measured.get(metric))} / {pred}"
                             if e.status in ("pass", "fail") else pred)
            lines.append(f"| {e.name} | {e.status} | " + " | ".join(cells) + " |")
    notes = [e for e in entries if e.note]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {e.name}: {e.note}" for e in notes]
    return "\n".join(lines) + "\n"
