"""Stage costs behind one interface: seconds for one batch step.

    cost.seconds(stage, batch, m, context) -> float
    cost.mixed_seconds(stage, batch, m, context, Chunk(batch, m, context)) -> float

stage: prefill | draft | verify | correction | decode; batch: sequences in the step;
m: new tokens per sequence (mean, may be fractional for mixed prefill chunks);
context: tokens already cached per sequence (mean). mixed_seconds prices one forward
carrying a decode/verify step and a prefill Chunk (colocated `prefill_schedule: mixed`).
Implementations: RooflineCost
(hardware description + model shape), TableCost (fixed ms per stage), ProfileCost
(fitted to measured steps). `build_costs` picks them for a scenario.
"""

from kestrel_sim.costs.base import Chunk, StageCost
from kestrel_sim.costs.build import build_costs
from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.table import TableCost

__all__ = ["Chunk", "ProfileCost", "RooflineCost", "StageCost", "TableCost", "build_costs"]
