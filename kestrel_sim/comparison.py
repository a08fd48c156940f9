"""A measured run held against a predicted one, metric by metric, under a scenario's
`validate` tolerances (kestrel_sim.validate_spec).

    rows = compare(measured, predicted, scenario.validate_, controlled=True)
    [r for r in rows if r.status == "fail"]

Both Metrics come from kestrel_sim.metrics (the same code for a Trace from the runtime and
one from the simulator). error_pct = (predicted - measured) / measured x 100. A row's
status: "pass" / "fail" (a checked metric within / past its tolerance), "info" (shown, not
checked), "skipped" (cannot be compared; `note` says why). The 95th percentiles (p95_*_ms),
which Metrics does not hold, are computed here from its per-request arrays.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from kestrel_sim.metrics import Metrics
from kestrel_sim.validate_spec import CHECKABLE, Validate

# shown beside the checkable metrics, never checked: counts and spreads
INFO = {"completed": "requests", "failed": "requests", "preemptions": "count",
        "max_concurrent_requests": "requests", "max_output_tokens_per_s": "tok/s",
        "std_ttft_ms": "ms", "std_tpot_ms": "ms", "spec_decode_acceptance_rate": "%"}
# in metrics.json but not a measurement of the served system
NOT_COMPARED = {"itl_source": "how the ITL statistics were computed (exact or histogram), "
                "not a measurement"}


@dataclass
class Row:
    metric: str
    unit: str
    measured: float | None
    predicted: float | None
    error_pct: float | None  # (predicted - measured) / measured x 100
    tolerance_pct: float | None  # None: not checked
    status: str  # pass | fail | info | skipped
    note: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["error_pct"] is not None and not math.isfinite(d["error_pct"]):
            d["error_pct"] = None  # JSON has no infinity; status says fail
            d["note"] = (d["note"] + "; " if d["note"] else "") + "measured 0, predicted not"
        return d


def per_request_tpot_ms(m: Metrics) -> np.ndarray:
    """TPOT of each completed request with more than one output token, in ms (as
    kestrel_sim.metrics: (E2EL - TTFT) / (output tokens - 1))."""
    out = np.asarray(m.output_lens, dtype=float)
    ttft, e2el = np.asarray(m.ttfts), np.asarray(m.latencies)
    multi = out > 1
    return (e2el[multi] - ttft[multi]) / (out[multi] - 1) * 1e3


def per_request_ms(m: Metrics) -> dict[str, np.ndarray]:
    """Per completed request: ttft, tpot, e2el in ms (for percentiles and CDFs)."""
    done = np.asarray(m.output_lens) > 0
    return {"ttft": np.asarray(m.ttfts)[done] * 1e3, "tpot": per_request_tpot_ms(m),
            "e2el": np.asarray(m.latencies)[done] * 1e3}


def value_of(m: Metrics, name: str) -> float | None:
    """A metric by name, p95_*_ms included; None where the run has none."""
    if name.startswith("p95_"):
        values = per_request_ms(m)[name.split("_")[1]]
        return float(np.percentile(values, 95)) if values.size else None
    value = getattr(m, name)
    return None if value is None else float(value)


def error_pct(measured: float, predicted: float) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / abs(measured) * 100.0


def _why_missing(name: str, measured: float | None, predicted: float | None) -> str:
    if measured is None and predicted is None:
        if name == "request_goodput":
            return "no SLO in the scenario: no goodput"
        if name.startswith("spec_decode"):
            return "no speculative decoding in the scenario"
        return "neither run has a value (no completed request)"
    side = "measured" if measured is None else "predicted"
    return f"the {side} run has no value"


def _row(name: str, unit: str, m: Metrics, p: Metrics, tolerance: float | None,
         note: str = "") -> Row:
    mv, pv = value_of(m, name), value_of(p, name)
    if mv is None or pv is None:
        return Row(name, unit, mv, pv, None, tolerance, "skipped", _why_missing(name, mv, pv))
    err = error_pct(mv, pv)
    status = "info" if tolerance is None else ("pass" if abs(err) <= tolerance else "fail")
    return Row(name, unit, mv, pv, err, tolerance, status, note)


def compare(measured: Metrics, predicted: Metrics, validate: Validate,
            controlled: bool = False) -> list[Row]:
    """Rows for every checkable metric (checked where validate says), the INFO metrics,
    stage shares and worker utilization, and the metrics not compared, with a note."""
    checks = validate.checks()
    rows = []
    for name, (unit, _) in CHECKABLE.items():
        note = ""
        if controlled and name.startswith("spec_decode"):
            note = ("controlled acceptance: both sides draw accepted lengths from "
                    "spec.acceptance, so this checks the draws, not a prediction")
        rows.append(_row(name, unit, measured, predicted, checks.get(name), note))
    rows += [_row(name, unit, measured, predicted, None) for name, unit in INFO.items()]
    rows += _shares(measured, predicted)
    rows += [Row(name, "", None, None, None, None, "skipped", why)
             for name, why in NOT_COMPARED.items()]
    return rows


def _shares(m: Metrics, p: Metrics) -> list[Row]:
    """Stage shares of busy time and worker utilization, side by side (info); a stage or
    worker on one side only is skipped with a note."""
    rows = []
    for field, unit, scale in (("stage_share", "%", 100.0), ("worker_utilization", "% busy",
                                                             100.0)):
        mine, theirs = getattr(m, field), getattr(p, field)
        for key in list(mine) + [k for k in theirs if k not in mine]:
            name = f"{field}[{key}]"
            if key in mine and key in theirs:
                mv, pv = scale * mine[key], scale * theirs[key]
                rows.append(Row(name, unit, mv, pv, error_pct(mv, pv), None, "info"))
            else:
                side = "measured" if key in mine else "predicted"
                value = scale * (mine.get(key) if key in mine else theirs[key])
                rows.append(Row(name, unit, value if key in mine else None,
                                value if key in theirs else None, None, None, "skipped",
                                f"only the {side} run has it"))
    return rows


def failures(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == "fail"]
