"""Pick the cost models a scenario asks for: one StageCost for the target, one for the draft.

    costs: {profile: FILE}                        measured profile (fitted terms + correction)
    costs: {roofline: {}}                         uncalibrated roofline of the hardware
    costs: {roofline: {calibrated_from: FILE}}    roofline with a profile's efficiencies
    costs: {table: {...}}                         fixed milliseconds per stage

A profile with kv_transfer measurements also gives the KV link (SimCosts.link), used where
the scenario names no serving.link; with overlap measurements, the contention of steps that
share a device (SimCosts.contention, used where serving.devices places two workers on
one; the default elsewhere: contention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kestrel_sim.costs.base import IDLE, Shares
from kestrel_sim.costs.calibrated import CalibratedRoofline
from kestrel_sim.costs.contention import Contention
from kestrel_sim.costs.profile import ProfileCost, ProfileFits, RoundOverhead
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.shape import model_shape, shape_hash
from kestrel_sim.costs.table import TableCost
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import Hardware, LinkSpec, hardware_for_device, load_hardware
from kestrel_sim.models import ModelShape
from kestrel_sim.placement import placement
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario


class _Zero:
    """A stage that costs nothing (e.g. the draft's prefill when the table folds it in)."""

    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        return 0.0

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float, chunk) -> float:
        return 0.0

    def shares(self, stage: str, batch: int, m: float, context: float, chunk=None) -> Shares:
        return IDLE


@dataclass
class SimCosts:
    target: object  # StageCost: prefill, verify, correction, decode
    draft: object | None  # StageCost: draft, prefill (the draft's own prompt pass)
    hardware: Hardware | None  # the target's device (memory, links), when known
    draft_hardware: Hardware | None
    source: str  # roofline | calibrated-roofline | table | profile
    link: LinkSpec | None = None  # the KV link fitted to the profile's kv_transfer rows
    mixed: bool = False  # the scenario prices mixed steps (colocated, prefill_schedule mixed)
    contention: Contention = field(default_factory=Contention)  # steps sharing a device
    shared: bool = False  # serving.devices places two workers or more on one device
    # the serving loop's host time per speculative round (a profile's round rows), or None
    round_overhead: RoundOverhead | None = None
    # ... and per plain decode round it cannot launch ahead (round rows of k = 0), or None
    decode_overhead: RoundOverhead | None = None


def needed_stages(sc: Scenario) -> list[str]:
    if sc.spec is None:
        return ["prefill", "decode"]
    return ["prefill", "verify"] + (["correction"] if sc.spec.correction == "separate" else [])


def build_costs(sc: Scenario, rng: np.random.Generator) -> SimCosts:
    costs = _build(sc, rng)
    where = placement(sc.serving)
    if where is not None:  # two workers or more placed on one device
        costs.shared = len(set(where.values())) < len(where)
    return costs


def _build(sc: Scenario, rng: np.random.Generator) -> SimCosts:
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
    mixed = sc.serving.mode == "colocated" and sc.serving.prefill_schedule == "mixed"

    if sc.costs is not None and sc.costs.table is not None:
        target = TableCost(sc.costs.table, rng)
        draft = TableCost(sc.costs.table, rng, zero_stages=("prefill",)) if sc.draft else None
        return SimCosts(target, draft, hw, draft_hw, "table", mixed=mixed)

    if profile is not None:
        check_quant(profile, profile_path, sc.quant)
        check_draft_quant(profile, profile_path, sc, draft_shape)
        fits = _fits(profile, profile_path, target_shape, draft_shape, check_model=sc.model)
        target = ProfileCost(profile, profile_path, fits=fits)
        target.require(needed_stages(sc))
        draft = None
        if sc.draft is not None:
            draft = _profile_draft(sc, fits, profile_path, draft_shape, draft_hw)
        # the profile's KV link where the scenario hands KV over and names no link
        hands_over = sc.serving.mode == "disaggregated" and sc.serving.link is None
        return SimCosts(target, draft, hw, draft_hw, "profile",
                        fits.link() if hands_over else None, mixed, fits.contention(),
                        round_overhead=round_overhead(sc, fits),
                        decode_overhead=fits.round_overhead(decode=True))

    ro = sc.costs.roofline if sc.costs is not None and sc.costs.roofline else None
    if ro is not None and ro.calibrated_from is not None:
        return _calibrated(sc, ro, hw, target_shape, draft_shape, draft_hw, mixed)
    kw = {"launch_us": ro.launch_us, "step_overhead_us": ro.step_overhead_us} if ro else {}
    target = RooflineCost(hw, target_shape, quant=sc.quant, **kw)
    draft = None
    if sc.draft is not None:
        draft = RooflineCost(draft_hw, draft_shape, quant=sc.draft.quant,
                             **(kw if sc.draft.device == "gpu" else {}))
    return SimCosts(target, draft, hw, draft_hw, "roofline", mixed=mixed)


def check_quant(profile: Profile, path: str, quant: str) -> None:
    """Refuse a profile measured with other weights than the scenario's quant."""
    measured = profile.fingerprint.quant or "none"
    if measured != quant:
        raise ConfigError(
            f"profile {path} was measured with quant '{measured}' but the scenario's quant is "
            f"'{quant}': measure that quantization (kestrel calibrate --quant {quant}), or use "
            "the roofline (costs: {roofline: {}})")


def check_draft_quant(profile: Profile, path: str, sc: Scenario,
                      shape: ModelShape | None) -> None:
    """Refuse a profile whose draft rows would price the scenario's draft (the same draft
    model, rows on the draft's device) but were measured with other weights than its
    draft.quant. Rows of another draft model are not used (_profile_draft), so their
    quantization does not matter."""
    if sc.draft is None or shape is None:
        return
    fp = profile.fingerprint
    rows = any(mm.stage in ("draft", "draft_prefill") and mm.device == sc.draft.device
               for mm in profile.measurements)
    if not rows or fp.draft_shape_hash != shape_hash(shape) or fp.draft_quant == sc.draft.quant:
        return
    raise ConfigError(
        f"profile {path} measured its draft {fp.draft_model} with quant '{fp.draft_quant}' "
        f"but the scenario's draft.quant is '{sc.draft.quant}': measure that draft (kestrel "
        f"calibrate --draft {sc.draft.model} --draft-quant {sc.draft.quant}), or use the "
        "roofline (costs: {roofline: {}})")


def _fits(profile: Profile, path: str, target: ModelShape, draft: ModelShape | None,
          check_model: str | None = None) -> ProfileFits:
    """The profile's fits, over the scenario's shapes where they are the ones measured.
    check_model: refuse a profile of another model (shape hash) than this one."""
    fp = profile.fingerprint
    same = fp.model_shape_hash == shape_hash(target)
    if check_model is not None and not same:
        raise ConfigError(
            f"profile {path} measures {fp.model} but the scenario's model is {check_model} "
            f"(shape hash {fp.model_shape_hash} vs {shape_hash(target)}): measure that "
            "model, or use the roofline (costs: {roofline: {}})")
    same_draft = draft is not None and fp.draft_shape_hash == shape_hash(draft)
    return ProfileFits(profile, target if same else None, draft if same_draft else None)


def _profile_draft(sc: Scenario, fits: ProfileFits, path: str, shape: ModelShape,
                   draft_hw: Hardware | None):
    """The draft's costs from a profile: its own rows where they measured this draft on
    this device; otherwise the profile's decode and prefill terms over the draft's shape
    (a GPU draft), or the uncalibrated roofline (a CPU draft without CPU rows)."""
    fp = fits.profile.fingerprint
    measured = fp.draft_shape_hash == shape_hash(shape) and any(
        mm.stage == "draft" and mm.device == sc.draft.device for mm in fits.profile.measurements)
    calibrated = None
    if sc.draft.device == "gpu" and draft_hw is not None:
        calibrated = CalibratedRoofline(fits, draft_hw, draft_hw, shape, path, role="draft")
    if measured:
        # the draft's own prompt pass: its draft_prefill rows, or without them the target's
        # prefill terms over the draft's shape (a GPU draft) or the roofline
        prompt = calibrated or (RooflineCost(draft_hw, shape) if draft_hw else _Zero())
        return ProfileCost(fits.profile, path, fallback=prompt,
                           stages=("draft", "draft_prefill"), fits=fits,
                           device=sc.draft.device)
    if calibrated is not None:
        return calibrated
    if draft_hw is None:
        raise ConfigError(
            f"profile {path} has no draft measurements of {sc.draft.model} and its device "
            f"'{fp.device}' has no bundled hardware description for the roofline: measure "
            "the draft stage, or name the hardware")
    return RooflineCost(draft_hw, shape)


def _calibrated(sc: Scenario, ro, hw: Hardware | None, target_shape: ModelShape,
                draft_shape: ModelShape | None, draft_hw: Hardware | None,
                mixed: bool) -> SimCosts:
    """costs: {roofline: {calibrated_from: FILE, measured_on: HW}}."""
    path = ro.calibrated_from
    profile = Profile.load(path)
    check_quant(profile, path, sc.quant)  # its efficiencies are those of its weights' kernels
    if sc.draft is not None and sc.draft.device == "gpu":  # a GPU draft: its rows price it
        check_draft_quant(profile, path, sc, draft_shape)
    fp = profile.fingerprint
    measured_on = (load_hardware(ro.measured_on) if ro.measured_on
                   else hardware_for_device(fp.device))
    if measured_on is None:
        raise ConfigError(
            f"costs.roofline.calibrated_from: profile {path} was measured on '{fp.device}', "
            "which has no bundled hardware description; give costs.roofline.measured_on "
            "(a hardware name or YAML with that device's bandwidth and flop rates)")
    fits = _fits(profile, path, target_shape, draft_shape)
    target = CalibratedRoofline(fits, measured_on, hw, target_shape, path)
    target.require(needed_stages(sc))
    draft = None
    if sc.draft is not None:
        draft = (CalibratedRoofline(fits, measured_on, draft_hw, draft_shape, path, role="draft")
                 if sc.draft.device == "gpu" else RooflineCost(draft_hw, draft_shape))
    return SimCosts(target, draft, hw, draft_hw, "calibrated-roofline", mixed=mixed,
                    contention=fits.contention(), round_overhead=round_overhead(sc, fits),
                    decode_overhead=fits.round_overhead(decode=True))


def round_overhead(sc: Scenario, fits: ProfileFits) -> RoundOverhead | None:
    """The profile's host time per speculative round, where the scenario speculates with
    the draft on the GPU (as the rounds were measured: a CPU draft's loop is another)."""
    if sc.draft is None or sc.draft.device != "gpu":
        return None
    return fits.round_overhead()


def describe_costs(costs: SimCosts) -> str:
    """Where a run's step times come from, for a table title: 'measured profile FILE',
    'roofline calibrated from FILE (...)', 'uncalibrated roofline (HARDWARE)' or 'fixed
    cost table'; the draft's where it differs, how mixed steps are priced where the
    scenario mixes, a KV link fitted to the profile, and the contention of steps that
    overlap where the workers share a device."""
    text = _describe(costs)
    if costs.shared:
        text += f"; {costs.contention.describe()}"
    return text


def _describe(costs: SimCosts) -> str:
    if costs.source == "table":
        return "fixed cost table"
    if costs.source == "roofline":
        return f"uncalibrated roofline ({costs.hardware.name})"
    name = Path(costs.target.path).name
    if costs.source == "calibrated-roofline":
        text = (f"roofline calibrated from {name} (measured on {costs.target.measured_on.name}, "
                f"applied to {costs.target.on.name})")
    else:
        text = f"measured profile {name}"
    if isinstance(costs.draft, RooflineCost):
        text += f"; draft: uncalibrated roofline ({costs.draft.hw.name})"
    elif costs.source == "profile" and isinstance(costs.draft, CalibratedRoofline):
        text += "; draft: the profile's decode and prefill terms over the draft's shape"
    if costs.mixed and costs.source == "profile":
        text += f"; mixed steps: {costs.target.mixed_source}"
    runtime = getattr(costs.target, "runtime", None)
    if costs.source == "profile" and runtime is not None:
        text += ("; steps at the runtime's graph batch buckets ("
                 f"{', '.join(map(str, runtime.batch_buckets))})")
    if costs.round_overhead is not None:
        text += f"; {costs.round_overhead.describe()}"
    if costs.decode_overhead is not None:
        text += f"; decode {costs.decode_overhead.describe()} (where not launched ahead)"
    if costs.link is not None:
        text += (f"; KV link fitted: {costs.link.bandwidth_gb_s:.3g} GB/s, "
                 f"{costs.link.latency_us:.3g} us")
    return text
