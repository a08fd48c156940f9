"""Pick the cost models a scenario asks for: one StageCost for the target, one for the draft."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.shape import model_shape
from kestrel_sim.costs.table import TableCost
from kestrel_sim.hardware import Hardware, hardware_for_device, load_hardware
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario


class _Zero:
    """A stage that costs nothing (e.g. the draft's prefill when the table folds it in)."""

    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        return 0.0


@dataclass
class SimCosts:
    target: object  # StageCost: prefill, verify, correction, decode
    draft: object | None  # StageCost: draft, prefill (the draft's own prompt pass)
    hardware: Hardware | None  # the target's device (memory, links), when known
    draft_hardware: Hardware | None
    source: str  # roofline | table | profile


def needed_stages(sc: Scenario) -> list[str]:
    if sc.spec is None:
        return ["prefill", "decode"]
    return ["prefill", "verify"] + (["correction"] if sc.spec.correction == "separate" else [])


def build_costs(sc: Scenario, rng: np.random.Generator) -> SimCosts:
    profile_path = sc.costs.profile if sc.costs else None
    hw: Hardware | None
    if sc.hardware.endswith(".json"):
        profile_path = profile_path or sc.hardware
        hw = None
    else:
        hw = load_hardware(sc.hardware)
    profile = Profile.load(profile_path) if profile_path else None
    if profile is not None and hw is None:
        hw = hardware_for_device(profile.fingerprint.device)

    target_shape = model_shape(sc.model)
    draft_shape = model_shape(sc.draft.model) if sc.draft else None
    draft_hw = None
    if sc.draft is not None:
        draft_hw = (
            load_hardware(sc.draft.hardware or "cpu-xeon") if sc.draft.device == "cpu" else hw
        )

    if sc.costs is not None and sc.costs.table is not None:
        target = TableCost(sc.costs.table, rng)
        draft = TableCost(sc.costs.table, rng, zero_stages=("prefill",)) if sc.draft else None
        return SimCosts(target, draft, hw, draft_hw, "table")

    if profile is not None:
        fallback = RooflineCost(hw, target_shape) if hw is not None else None
        target = ProfileCost(profile, profile_path, fallback=None)
        target.require(needed_stages(sc))
        draft = None
        if sc.draft is not None:
            if sc.draft.device == "cpu" or not target.has("draft"):
                if draft_hw is None:
                    ProfileCost(profile, profile_path).require(["draft"])
                draft = RooflineCost(draft_hw, draft_shape)
            else:
                roof = RooflineCost(draft_hw, draft_shape) if draft_hw is not None else _Zero()
                draft = ProfileCost(profile, profile_path, fallback=roof)
                draft._fits.pop("prefill", None)  # prefill entries measure the target
        del fallback
        return SimCosts(target, draft, hw, draft_hw, "profile")

    ro = sc.costs.roofline if sc.costs is not None and sc.costs.roofline else None
    kw = {"launch_us": ro.launch_us, "step_overhead_us": ro.step_overhead_us} if ro else {}
    target = RooflineCost(hw, target_shape, **kw)
    draft = None
    if sc.draft is not None:
        draft = RooflineCost(draft_hw, draft_shape, **(kw if sc.draft.device == "gpu" else {}))
    return SimCosts(target, draft, hw, draft_hw, "roofline")
