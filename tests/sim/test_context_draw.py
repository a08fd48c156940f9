"""A drawn request past the model's context is refused by the simulator (item 3 of issue 25:
the tail of a normal or lognormal length without a max)."""

from __future__ import annotations

import pytest

from kestrel_sim import simulate
from kestrel_sim.errors import KestrelError
from kestrel_sim.scenario import Scenario


def test_an_unbounded_length_drawn_past_the_context_is_refused():
    sc = Scenario.load_from_dict({
        "model": "qwen3-0.6b",
        "workload": {"arrivals": {"process": "poisson", "rate": 5}, "requests": 50,
                     "prompt_tokens": {"dist": "lognormal", "mean": 30000, "std": 30000},
                     "output_tokens": {"dist": "fixed", "value": 10}, "seed": 1}})
    with pytest.raises(KestrelError, match="context"):
        simulate(sc)
