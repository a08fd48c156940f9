"""Pick the cost models a scenario asks for: one StageCost for the target, one for the draft."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.shape import model_shape
from kestrel_sim.costs.table import TableCost
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import Hardware, hardware_for_device, load_hardware
from kestrel_sim.models import PRESETS
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario


class _Zero:
    """A stage that costs nothing (e.g. the draft's prefill when the table folds it in)."""

    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        return 0.0

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float, chunk) -> float:
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
    # hardware: a bundled/YAML description, or a Profile JSON (its fingerprint names the
    # device); the Profile prices steps unless `costs` picks another model explicitly
    profile_path = sc.costs.profile if sc.costs else None
    hw: Hardware | None
    if sc.hardware.endswith(".json"):
        hw_profile = Profile.load(sc.hardware)
        hw = hardware_for_device(hw_profile.fingerprint.device)
        if sc.costs is None:
            profile_path = sc.hardware
    else:
        hw = load_hardware(sc.hardware)
    profile = Profile.load(profile_path) if profile_path else None
    if profile is not None and hw is None:
        hw = hardware_for_device(profile.fingerprint.device)
    if hw is None and (sc.costs is None or sc.costs.table is None) and profile is None:
        raise ConfigError(
            f"hardware {sc.hardware}: no bundled description matches the profile's device, "
            "so the roofline cannot be used; give a hardware name or YAML"
        )

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
        fp = profile.fingerprint
        if sc.model in PRESETS and fp.model.lower() in PRESETS and fp.model.lower() != sc.model:
            raise ConfigError(
                f"profile {profile_path} measures {fp.model} but the scenario's model is "
                f"{sc.model}: measure that model, or use the roofline (costs: {{roofline: {{}}}})"
            )
        target = ProfileCost(profile, profile_path)
        target.require(needed_stages(sc))
        draft = None
        if sc.draft is not None:
            other_draft = fp.draft_model is not None and fp.draft_model.lower() != sc.draft.model
            if sc.draft.device == "cpu" or not target.has("draft") or other_draft:
                if draft_hw is None:
                    raise ConfigError(
                        f"profile {profile_path} has no draft measurements of {sc.draft.model} "
                        f"and its device '{fp.device}' has no bundled hardware description "
                        "for the roofline: measure the draft stage, or name the hardware"
                    )
                draft = RooflineCost(draft_hw, draft_shape)
            else:
                # the draft's own prompt pass is not in the profile (its prefill rows
                # measure the target): roofline where the device is known
                roof = RooflineCost(draft_hw, draft_shape) if draft_hw is not None else _Zero()
                draft = ProfileCost(profile, profile_path, fallback=roof, stages=("draft",))
        return SimCosts(target, draft, hw, draft_hw, "profile")

    ro = sc.costs.roofline if sc.costs is not None and sc.costs.roofline else None
    kw = {"launch_us": ro.launch_us, "step_overhead_us": ro.step_overhead_us} if ro else {}
    target = RooflineCost(hw, target_shape, **kw)
    draft = None
    if sc.draft is not None:
        draft = RooflineCost(draft_hw, draft_shape, **(kw if sc.draft.device == "gpu" else {}))
    return SimCosts(target, draft, hw, draft_hw, "roofline")


def describe_costs(costs: SimCosts) -> str:
    """Where a run's step times come from, for a table title: 'measured profile FILE',
    'uncalibrated roofline (HARDWARE)' or 'fixed cost table'; the draft's where it differs
    (a profile without the draft's steps, or a CPU draft, prices the draft by roofline)."""
    if costs.source == "table":
        return "fixed cost table"
    if costs.source == "roofline":
        return f"uncalibrated roofline ({costs.hardware.name})"
    text = f"measured profile {Path(costs.target.path).name}"
    if isinstance(costs.draft, RooflineCost):
        text += f"; draft: uncalibrated roofline ({costs.draft.hw.name})"
    return text
