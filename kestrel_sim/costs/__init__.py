"""Stage costs behind one interface: seconds for one batch step.

    cost.seconds(stage, batch, m, context) -> float
    cost.mixed_seconds(stage, batch, m, context, Chunk(batch, m, context)) -> float
    cost.shares(stage, batch, m, context[, chunk]) -> Shares   # how it uses its device

stage: prefill | draft | verify | correction | decode; batch: sequences in the step;
m: new tokens per sequence (mean, may be fractional for mixed prefill chunks);
context: tokens already cached per sequence (mean). mixed_seconds prices one forward
carrying a decode/verify step and a prefill Chunk (colocated `prefill_schedule: mixed`).
Implementations: RooflineCost (hardware description + model shape), TableCost (fixed
ms per stage), ProfileCost (physical terms fitted to a measured Profile, plus a measured
correction), CalibratedRoofline (a profile's fitted efficiencies on another device's
description). `build_costs` picks them for a scenario.

Modules: work.py (bytes and flops of a step), fit.py (the physical terms and their
non-negative least-squares fit), nnls.py, correction.py, stage_model.py (one stage's
fitted cost), profile.py (ProfileFits, ProfileCost), calibrated.py, report.py (held-out
error of a profile's fits), roofline.py, table.py, build.py, contention.py (how much
steps of workers sharing one device slow each other, and its fit to overlap rows).
"""

from kestrel_sim.costs.base import Chunk, StageCost
from kestrel_sim.costs.build import build_costs
from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.table import TableCost

__all__ = ["CalibratedRoofline", "Chunk", "ProfileCost", "RooflineCost", "StageCost",
           "TableCost", "build_costs"]
