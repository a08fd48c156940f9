"""The `costs` part of a Scenario: which stage-cost model prices the steps.

Re-exported by kestrel_sim.scenario; built into StageCosts by kestrel_sim.costs.build.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kestrel_sim.errors import ConfigError
from kestrel_sim.profile import Profile
from kestrel_sim.schema_base import StrictModel, resolve_file


class RooflineCosts(StrictModel):
    """The analytic model from the hardware description; fields override it."""

    launch_us: float | None = Field(default=None, ge=0, description="per kernel launch")
    step_overhead_us: float | None = Field(default=None, ge=0, description="fixed per step")


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
        if v is None:
            return None
        path = resolve_file(v, info, "profile")
        try:
            Profile.load(path)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return path

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [n for n in ("roofline", "table", "profile") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of roofline, table or profile (got {', '.join(given)})")
        return self
