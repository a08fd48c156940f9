"""The `validate` part of a Scenario: what `kestrel run --on both` holds the simulator to.

    validate:
      tolerance_pct: {p95_e2el_ms: 10, median_ttft_ms: null}   # add a check, drop one
      held_out: true      # not in the calibration grid: reported apart by `kestrel validate`
      note: "k = 6 and 1536-token prompts: neither is on the calibration grid"
      pending: "..."      # the runtime cannot run this scenario yet; --on hardware refuses it

Every scenario has one (all defaults when the key is absent). The error of a metric is
(predicted - measured) / measured in percent; a check fails when its absolute value passes
the metric's tolerance. Checkable metrics are the scalar metrics of kestrel_sim.metrics that
both sides measure the same way, and the 95th percentiles of TTFT, TPOT and E2E latency
(computed from the per-request arrays, kestrel_sim.comparison). Metrics a check cannot
apply to (goodput without an SLO, acceptance without a draft) are skipped with a note.
"""

from __future__ import annotations

from pydantic import Field, create_model

from kestrel_sim.schema_base import StrictModel

# a latency's default tolerances in percent (the others are shown, not checked unless asked)
LATENCY_DEFAULTS = {"ttft": {"median": 10.0, "p99": 10.0}, "tpot": {"median": 5.0},
                    "itl": {}, "e2el": {}}


def _checkable() -> dict[str, tuple[str, float | None]]:
    """metric -> (unit, default tolerance in percent, or None: not checked by default)."""
    out: dict[str, tuple[str, float | None]] = {
        "duration": ("s", None),
        "request_throughput": ("req/s", 5.0),
        "output_throughput": ("tok/s", 5.0),
        "total_token_throughput": ("tok/s", None),
        "request_goodput": ("req/s", None),
    }
    for key, defaults in LATENCY_DEFAULTS.items():
        for stat in ("mean", "median", "p95", "p99"):
            if key == "itl" and stat == "p95":
                continue  # ITL gaps are pooled over requests: p95 is not kept
            out[f"{stat}_{key}_ms"] = ("ms", defaults.get(stat))
    out["spec_decode_acceptance_length"] = ("tok/round", None)
    return out


CHECKABLE = _checkable()

Tolerances = create_model(
    "Tolerances",
    __base__=StrictModel,
    __doc__="Percent allowed between predicted and measured, per metric; null: not checked "
            "(still shown).",
    **{name: (float | None, Field(default=default, gt=0, description=f"percent ({unit})"))
       for name, (unit, default) in CHECKABLE.items()},
)


class Validate(StrictModel):
    """How `kestrel run --on both` and `kestrel validate` judge this scenario."""

    tolerance_pct: Tolerances = Field(  # type: ignore[valid-type]
        default_factory=Tolerances,
        description="per metric: the largest |predicted - measured| / measured, in percent, "
        "that passes; defaults: throughput 5, median TPOT 5, median and p99 TTFT 10",
    )
    held_out: bool = Field(
        default=False,
        description="true: the scenario lies outside the calibration grid (other k, loads or "
        "lengths); `kestrel validate` reports its errors apart",
    )
    note: str | None = Field(default=None, description="why held out, or what to look at")
    pending: str | None = Field(
        default=None,
        description="set while the runtime cannot run this scenario as written (a syntax or "
        "feature still missing): --on hardware and --on both refuse it with this text",
    )

    def checks(self) -> dict[str, float]:
        """metric -> tolerance percent, for the metrics checked."""
        return {k: v for k, v in self.tolerance_pct.model_dump().items() if v is not None}


# A validation suite's summary (kestrel_cli/suite_summary.py, reports/suite.py): its headline
# columns (metric, label); TARGETS, issue 23's median absolute errors in percent; a scenario
# with a headline error past EXPLAIN_PCT is listed to be explained; the deployer's ladder is
# the scenarios named LADDER_PREFIX...
HEADLINE = [("output_throughput", "output tok/s"), ("request_throughput", "req/s"),
            ("median_tpot_ms", "TPOT p50 ms"), ("median_ttft_ms", "TTFT p50 ms"),
            ("p95_ttft_ms", "TTFT p95 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
            ("p95_e2el_ms", "E2EL p95 ms"), ("duration", "duration s")]
TARGETS = {"output_throughput": 3.0, "request_throughput": 3.0, "median_tpot_ms": 3.0,
           "median_ttft_ms": 5.0, "p99_ttft_ms": 5.0}
EXPLAIN_PCT = 10.0
LADDER_PREFIX = "ladder-"
