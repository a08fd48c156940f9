"""The speculative decoding part of a Scenario: `spec` (k, correction) and its `acceptance`
(how many draft tokens the target accepts). Re-exported by kestrel_sim.scenario; drawn by
kestrel_sim.acceptance, and by the runtime's controlled mode (kestrel_rt/spec/controlled.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from kestrel_sim.datafiles import read_counts
from kestrel_sim.errors import ConfigError
from kestrel_sim.measured_acceptance import (
    MeasuredAcceptance,
    calibrate_command,
    check_pair,
    profile_for,
)
from kestrel_sim.models import PRESETS
from kestrel_sim.profile import Profile
from kestrel_sim.schema_base import StrictModel, resolve_file


class Acceptance(StrictModel):
    """Exactly one of: `alpha` (each draft token accepted with probability alpha, independent),
    `per_position` (probability that draft position i is accepted given 0..i-1 were; at
    least k entries), `trace` (a file of measured accepted lengths per round, whole numbers
    0..k, sampled with replacement), `from_profile` (the per-position rates a calibration
    measured for this draft pair on the device: true takes the scenario's profile, costs.
    profile or a Profile JSON hardware; or a Profile JSON of its own; resolved when the
    Scenario is validated, kestrel_sim/measured_acceptance.py; where the profile holds each
    measured sequence's agreement, the simulator replays one per request unless `per_request:
    pooled`, kestrel_sim/sequence_acceptance.py). A trace measured at a larger
    k than the scenario's says so in `measured_k`; a length L then counts as min(L, k), which
    is exact: whether the first k drafts are accepted does not depend on the ones after
    them."""

    alpha: float | None = Field(default=None, ge=0, le=1)
    per_position: list[Annotated[float, Field(ge=0, le=1)]] | None = None
    trace: str | None = None
    measured_k: int | None = Field(
        default=None, ge=1, le=64,
        description="trace only: the k the trace was measured at (its lengths are 0..measured_k)",
    )
    from_profile: bool | str = Field(
        default=False,
        description="true: the per-position rates measured on the device by `kestrel "
        "calibrate --draft-quant ...`, from the scenario's profile (costs.profile, or a "
        "Profile JSON hardware); or a Profile JSON path to take them from",
    )
    per_request: Literal["auto", "measured", "pooled"] = Field(
        default="auto",
        description="from_profile only: how the simulator draws a request's accepted lengths: "
        "measured (each request replays one sequence the calibration measured, so requests "
        "differ as measured ones did), pooled (every request draws from the pooled "
        "per-position rates), or auto: measured where the profile holds the sequences",
    )
    on_hardware: Literal["auto", "controlled", "organic"] = Field(
        default="auto",
        description="how `--on hardware` accepts drafts: controlled (the real draft, verify "
        "and correction work, the number accepted drawn from these rates), organic (what the "
        "target really accepts: the rates here are then the simulator's, e.g. measured), or "
        "auto: controlled when a model has random (preset) weights, which never agree, "
        "organic otherwise",
    )

    # the Profile block from_profile resolved to (Scenario validation): (its file, block)
    _measured: tuple[str, MeasuredAcceptance] | None = PrivateAttr(default=None)

    @property
    def measured(self) -> tuple[str, MeasuredAcceptance] | None:
        """(profile file, its acceptance block) of a from_profile acceptance, once resolved."""
        return self._measured

    def rates(self, k: int) -> list[float] | None:
        """The per-position rates of positions 1..k: given, or from the profile."""
        if self.from_profile:
            if self._measured is None:
                raise ConfigError("spec.acceptance.from_profile is resolved with its scenario "
                                  "(Scenario validation), which this acceptance was not")
            return self._measured[1].conditional_rates[:k]
        return None if self.per_position is None else self.per_position[:k]

    def sequences(self) -> list[str] | None:
        """The measured agreement strings the simulator replays one per request (from_profile,
        unless per_request is pooled, where the profile holds them); None: the rates."""
        if not self.from_profile or self.per_request == "pooled" or self._measured is None:
            return None
        return self._measured[1].sequences

    @model_serializer(mode="wrap")
    def _dump_from_profile_when_given(self, handler):
        """Dumps of scenarios without from_profile or per_request stay as they were before
        them (kept measurements compare a scenario's dump: kestrel_cli/kept.py)."""
        data = handler(self)
        if isinstance(data, dict) and data.get("from_profile") is False:
            data.pop("from_profile")
        if isinstance(data, dict) and data.get("per_request") == "auto":
            data.pop("per_request")
        return data

    @field_validator("from_profile")
    @classmethod
    def _profile_exists(cls, v: bool | str, info: ValidationInfo) -> bool | str:
        if isinstance(v, str):
            return resolve_file(v, info, "acceptance profile")
        return v

    @field_validator("trace")
    @classmethod
    def _exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        path = resolve_file(v, info, "acceptance trace")
        try:
            read_counts(path, "acceptance trace", low=0)  # the bound on lengths: see Spec
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return path

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [n for n in ("alpha", "per_position", "trace") if getattr(self, n) is not None]
        given += ["from_profile"] if self.from_profile is not False else []
        if len(given) != 1:
            raise ValueError(
                "give exactly one of alpha, per_position, trace or from_profile"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.measured_k is not None and self.trace is None:
            raise ValueError("measured_k only applies to an acceptance trace")
        if self.per_request != "auto" and self.from_profile is False:
            raise ValueError(f"per_request: {self.per_request} only applies to from_profile "
                             "(the sequences a calibration measured); drop it")
        return self


class Spec(StrictModel):
    k: int = Field(ge=1, le=64, description="draft tokens proposed per round")
    correction: Literal["separate", "fused"] = "fused"
    acceptance: Acceptance

    @field_validator("acceptance")
    @classmethod
    def _fits_k(cls, acc: Acceptance, info: ValidationInfo) -> Acceptance:
        k = info.data.get("k")
        if k is None:
            return acc  # k itself is invalid, and says so
        pp = acc.per_position
        if pp is not None and len(pp) < k:
            raise ValueError(f"per_position has {len(pp)} rates but k is {k}: give at least k")
        if acc.trace is not None:
            measured = acc.measured_k
            if measured is not None and measured < k:
                raise ValueError(
                    f"k is {k} but the acceptance trace was measured at k = {measured} "
                    "(measured_k): it cannot say how often the drafts after position "
                    f"{measured} would be accepted; lower k or measure at k = {k}")
            hint = (f" (measured_k = {measured})" if measured else
                    f" (k = {k}); if the trace was measured at a larger k, say which in "
                    "acceptance.measured_k (lengths then count as min(length, k))")
            try:
                read_counts(acc.trace, "acceptance trace", low=0, high=measured or k,
                            high_hint=hint)
            except ConfigError as err:
                raise ValueError(str(err)) from None
        return acc


def same_model(name: str, other: str) -> bool:
    """Whether scenario model `name` is the one a profile names `other`: presets by name,
    folders by the folder's own name (the measuring machine's path is not this one's)."""
    if name in PRESETS or other.lower() in PRESETS:
        return name == other.lower()
    return Path(name).name == Path(other).name


def resolve_measured(sc) -> tuple[str, MeasuredAcceptance]:
    """(profile file, its acceptance block) for a Scenario `sc` whose spec.acceptance has
    from_profile; ValueError, naming the key, the file and the command that measures it,
    where there is none of this pair (its target, draft, draft quant and device) and k."""
    acc, key = sc.spec.acceptance, "spec.acceptance.from_profile"
    costs_profile = sc.costs.profile if sc.costs is not None else None
    path = profile_for(acc.from_profile, costs_profile, sc.hardware)
    draft = sc.draft
    command = calibrate_command(sc.model, draft.model, draft.quant, draft.device)
    if path is None:
        raise ValueError(f"{key}: the scenario names no Profile to take the acceptance from "
                         "(no costs.profile, and its hardware is not a Profile JSON): give "
                         f"one ({key}: PROFILE.json, or costs: {{profile: PROFILE.json}}), "
                         f"measured by `{command}`")
    try:
        profile = Profile.load(path)
    except ConfigError as err:
        raise ValueError(f"{key}: {err}") from None
    fp, block = profile.fingerprint, profile.acceptance
    if block is None:
        raise ValueError(f"{key}: profile {path} holds no acceptance measurement (its "
                         "calibration had no --draft-quant, or predates it): measure the pair "
                         f"with `{command}` and use that profile")
    if not same_model(sc.model, fp.model):
        raise ValueError(f"{key}: profile {path} measured target {fp.model}, not the "
                         f"scenario's model {sc.model}: measure this pair (`{command}`)")
    if not same_model(draft.model, block.draft_model):
        raise ValueError(f"{key}: profile {path} measured draft {block.draft_model}, not the "
                         f"scenario's draft.model {draft.model}: measure this pair "
                         f"(`{command}`)")
    try:
        check_pair(block, path, sc.spec.k, draft.quant, draft.device, command)
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from None
    if acc.per_request == "measured" and block.sequences is None:
        raise ValueError(f"spec.acceptance.per_request: measured, but profile {path} holds no "
                         "measured sequences (its calibration predates them): measure the "
                         f"pair again (`{command}`), or set per_request: pooled")
    return path, block
