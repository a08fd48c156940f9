"""The time between a serving loop's steps, and what happened in each gap (kestrel_sim/gaps.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kestrel_sim.gaps import gap_causes
from kestrel_sim.trace import RequestRecord, Span, Trace


def test_each_gap_counts_under_every_cause_it_shows():
    ms = 1e-3
    spans = [Span("decode", "decode0/target", 0 * ms, 10 * ms, [0]),
             # gap 10..11 ms: nothing happened in it
             Span("decode", "decode0/target", 11 * ms, 20 * ms, [0]),
             Span("kv_transfer", "link0", 15 * ms, 19 * ms, [1]),
             # gap 20..22 ms: request 1 landed in the step before; rows change
             Span("decode", "decode0/target", 22 * ms, 30 * ms, [0, 1]),
             Span("prefill", "prefill0/target", 29 * ms, 33 * ms, [2]),
             # gap 30..34 ms: the prefill loop ran for 3 of its 4 ms
             Span("decode", "decode0/target", 34 * ms, 40 * ms, [0, 1])]
    requests = [RequestRecord(0, 0.0, 8, prefill_start=0.0, decode_start=0.0, finish=0.040),
                RequestRecord(1, 0.0, 8, prefill_start=0.0, decode_start=0.022,
                              finish=0.040)]
    trace = Trace(spans=spans, requests=requests,
                  meta={"placement": {"decode0": "cuda:0", "prefill0": "cuda:0"}})
    got = gap_causes(trace)["decode0"]
    assert got["gaps"] == 3
    assert got["gap_s"] == pytest.approx(7 * ms)
    assert got["after_handover_s"] == pytest.approx(2 * ms)
    assert got["rows_changed_s"] == pytest.approx(2 * ms)
    assert got["beside_s"] == pytest.approx(3 * ms)
    assert got["none_s"] == pytest.approx(1 * ms)
    trace.meta["placement"] = {"decode0": "cuda:0", "prefill0": "cuda:1"}
    assert gap_causes(trace)["decode0"]["beside_s"] == 0.0  # another GPU's loop


def test_a_simulated_runs_gaps_are_its_round_overheads():
    from kestrel_sim.scenario import load_scenario
    from kestrel_sim.sim.engine import simulate

    root = Path(__file__).resolve().parents[2]
    sc = load_scenario(root / "scenarios/validation/disaggregated-light.yaml",
                       ["workload.requests=12"])
    got = gap_causes(simulate(sc, trace="full"))
    assert set(got) == {"prefill0", "decode0"}
    decode = got["decode0"]
    assert decode["gaps"] > 0 and 0.0 < decode["p50_ms"] < 5.0  # the profile's round overhead
    assert decode["gap_s"] >= max(decode["after_handover_s"], decode["rows_changed_s"],
                                  decode["beside_s"], decode["none_s"])
