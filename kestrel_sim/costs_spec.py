"""The `costs` part of a Scenario: which stage-cost model prices the steps.

Re-exported by kestrel_sim.scenario; built into StageCosts by kestrel_sim.costs.build.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import bundled_names, load_hardware
from kestrel_sim.profile import Profile
from kestrel_sim.schema_base import StrictModel, in_base_dir, resolve_file


def profile_file(v: str | None, info: ValidationInfo, key: str) -> str | None:
    """The Profile JSON a scenario key names, resolved against the scenario's folder and
    loaded once to check it (None stays None)."""
    if v is None:
        return None
    path = resolve_file(v, info, key)
    try:
        Profile.load(path)
    except ConfigError as err:
        raise ValueError(str(err)) from None
    return path


class RooflineCosts(StrictModel):
    """The analytic model from the hardware description; fields override it. With
    `calibrated_from` a Profile JSON, its fitted efficiencies (fraction of bandwidth, of
    matmul and attention rate; overhead per forward) are applied to this scenario's
    hardware (kestrel_sim.costs.calibrated)."""

    launch_us: float | None = Field(default=None, ge=0, description="per kernel launch")
    step_overhead_us: float | None = Field(default=None, ge=0, description="fixed per step")
    calibrated_from: str | None = Field(
        default=None, description="a Profile JSON whose fitted efficiencies calibrate the "
        "roofline (measured on another device, applied to this scenario's hardware)")
    measured_on: str | None = Field(
        default=None, description="calibrated_from only: the hardware (bundled name or YAML) "
        "the profile was measured on; default the bundled one its fingerprint names")

    @field_validator("calibrated_from")
    @classmethod
    def _profile_exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        return profile_file(v, info, "calibrated_from")

    @field_validator("measured_on")
    @classmethod
    def _hardware_exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None or v.lower() in bundled_names():
            return None if v is None else v.lower()
        path = in_base_dir(v, info)
        try:
            load_hardware(str(path))
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return str(path.resolve())

    @model_validator(mode="after")
    def _calibration_fields(self):
        if self.calibrated_from is not None:
            fixed = [n for n in ("launch_us", "step_overhead_us") if getattr(self, n) is not None]
            if fixed:
                raise ValueError(f"{', '.join(fixed)} cannot be given with calibrated_from "
                                 "(the profile's fitted overhead replaces them)")
        elif self.measured_on is not None:
            raise ValueError("measured_on only applies with calibrated_from")
        return self


StageTime = Annotated[float, Field(ge=0)] | dict[int, Annotated[float, Field(ge=0)]]


class TableCosts(StrictModel):
    """Fixed milliseconds per step, per stage; a mapping {batch size: ms} is interpolated
    linearly in batch size (clamped). `service: exponential` draws each step's time from an
    exponential distribution with the table's value as mean (for queueing checks)."""

    prefill: StageTime | None = None
    prefill_per_token: float | None = Field(
        default=None, ge=0, description="ms per prompt token, added to `prefill`"
    )
    draft: StageTime | None = None
    verify: StageTime | None = None
    correction: StageTime | None = None
    decode: StageTime | None = None
    service: Literal["fixed", "exponential"] = "fixed"

    @field_validator("prefill", "draft", "verify", "correction", "decode")
    @classmethod
    def _batches(cls, v):
        if isinstance(v, dict):
            if not v:
                raise ValueError("a per-batch table needs at least one {batch: ms} entry")
            bad = [b for b in v if b < 1]
            if bad:
                raise ValueError(f"batch sizes must be >= 1, got {bad}")
        return v


class Costs(StrictModel):
    """Exactly one of roofline (the default), table or profile (a Profile JSON)."""

    roofline: RooflineCosts | None = None
    table: TableCosts | None = None
    profile: str | None = None

    @field_validator("profile")
    @classmethod
    def _exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        return profile_file(v, info, "profile")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [n for n in ("roofline", "table", "profile") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of roofline, table or profile (got {', '.join(given)})")
        return self
