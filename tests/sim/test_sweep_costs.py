"""The costs label a sweep prints: one where every point prices its steps the same way,
each distinct one where an axis changes how (here the serving keys that place workers)."""

from __future__ import annotations

from pathlib import Path

from kestrel_cli.render import costs_label
from kestrel_cli.sweep import sweep_costs
from kestrel_sim.scenario import Scenario
from kestrel_sim.yamlio import load_model

DEFAULT = Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml"


def with_serving(sc: Scenario, **serving) -> Scenario:
    return Scenario.model_validate({**sc.model_dump(), "serving": {
        **sc.serving.model_dump(), **serving}})


def test_points_that_price_alike_share_one_label():
    sc = load_model(DEFAULT, Scenario)
    other = with_serving(sc, max_batch=sc.serving.max_batch // 2)
    assert sweep_costs([sc, other]) == costs_label(sc)


def test_an_axis_that_places_workers_on_one_device_gets_its_own_label():
    sc = load_model(DEFAULT, Scenario)
    shared = with_serving(sc, mode="disaggregated", devices=["cuda:0"])
    assert costs_label(shared) != costs_label(sc)
    label = sweep_costs([sc, shared])
    assert label == f"costs by point: {costs_label(sc)} | {costs_label(shared)}"
