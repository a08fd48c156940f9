"""Stage costs behind one interface: seconds for one batch step.

    cost.seconds(stage, batch, m, context) -> float

stage: prefill | draft | verify | correction | decode; batch: sequences in the step;
m: new tokens per sequence (mean, may be fractional for mixed prefill chunks);
context: tokens already cached per sequence (mean). Implementations: RooflineCost
(hardware description + model shape), TableCost (fixed ms per stage), ProfileCost
(fitted to measured steps). `build_costs` picks them for a scenario.
"""

from kestrel_sim.costs.base import StageCost
from kestrel_sim.costs.build import build_costs
from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.table import TableCost

__all__ = ["ProfileCost", "RooflineCost", "StageCost", "TableCost", "build_costs"]
