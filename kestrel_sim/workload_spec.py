"""The workload part of a Scenario: arrival processes and length distributions.

Discriminated unions (`process`, `dist`) so a validation error names the right member.
Re-exported by kestrel_sim.scenario; drawn by kestrel_sim.workload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kestrel_sim.datafiles import read_numbers, read_replay
from kestrel_sim.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def in_base_dir(value: str | Path, info: ValidationInfo) -> Path:
    """`value` as a path; a relative one is taken from the validation context's base_dir
    (the scenario file's folder)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path((info.context or {}).get("base_dir", ".")) / path


def resolve_file(value: str | Path, info: ValidationInfo, what: str) -> str:
    """`value` made absolute against the context's base_dir; an error if it does not exist."""
    path = in_base_dir(value, info)
    if not path.exists():
        raise ValueError(f"{what} file '{value}' not found (looked for {path.resolve()})")
    return str(path.resolve())


# ---------------------------------------------------------------- length distributions


class FixedDist(_Strict):
    """Every request has `value` tokens."""

    dist: Literal["fixed"]
    value: int = Field(ge=1)


class UniformDist(_Strict):
    """Integers uniform on [low, high], both included."""

    dist: Literal["uniform"]
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self):
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self


class _Clipped(_Strict):
    @model_validator(mode="after")
    def _ordered(self):
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class NormalDist(_Clipped):
    """Normal with this mean and std, rounded, clipped to [min, max] (min at least 1)."""

    dist: Literal["normal"]
    mean: float = Field(gt=0)
    std: float = Field(ge=0)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)


class LognormalDist(_Clipped):
    """Lognormal whose *token counts* have this mean and std, rounded, clipped to [min, max]."""

    dist: Literal["lognormal"]
    mean: float = Field(gt=0)
    std: float = Field(gt=0)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)


class EmpiricalDist(_Strict):
    """Values drawn with replacement from a file: integers separated by whitespace, commas or
    newlines (`#` starts a comment), or a JSON list."""

    dist: Literal["empirical"]
    file: str

    @field_validator("file")
    @classmethod
    def _exists(cls, v: str, info: ValidationInfo) -> str:
        path = resolve_file(v, info, "empirical distribution")
        try:
            values = read_numbers(path, "empirical distribution")
        except ConfigError as err:
            raise ValueError(str(err)) from None
        if (values < 1).any():
            raise ValueError(f"empirical distribution file {path} holds lengths below 1")
        return path


LengthDist = Annotated[
    FixedDist | UniformDist | NormalDist | LognormalDist | EmpiricalDist,
    Field(discriminator="dist"),
]


# ---------------------------------------------------------------- arrival processes


class PoissonArrivals(_Strict):
    """Open loop, exponential inter-arrival times with mean 1/rate."""

    process: Literal["poisson"]
    rate: float = Field(gt=0, description="requests per second")


class GammaArrivals(_Strict):
    """Open loop, gamma inter-arrival times: mean 1/rate, coefficient of variation `cv`
    (cv = 1 is Poisson, cv > 1 is burstier, cv < 1 smoother)."""

    process: Literal["gamma"]
    rate: float = Field(gt=0, description="requests per second")
    cv: float = Field(gt=0, description="burstiness: std/mean of inter-arrival times")


class ClosedLoopArrivals(_Strict):
    """`concurrency` clients; each sends a request, waits for its last token, thinks
    `think_time_s`, and sends the next."""

    process: Literal["closed"]
    concurrency: int = Field(ge=1)
    think_time_s: float = Field(default=0.0, ge=0)


class ReplayArrivals(_Strict):
    """Arrival times replayed from a file: a CSV with a header holding `arrival` (or
    `timestamp`) and optionally `prompt_tokens` and `output_tokens` columns (which then
    override the length distributions), or a plain list of times, one per line."""

    process: Literal["replay"]
    file: str
    time_unit: Literal["s", "ms"] = "s"
    speedup: float = Field(default=1.0, gt=0, description="divide the replayed gaps by this")

    @field_validator("file")
    @classmethod
    def _exists(cls, v: str, info: ValidationInfo) -> str:
        path = resolve_file(v, info, "arrival trace")
        try:
            columns = read_replay(path)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        for key in ("prompt_tokens", "output_tokens"):
            if key in columns and (columns[key] < 1).any():
                raise ValueError(f"arrival trace {path}: {key} must be >= 1")
        return path


Arrivals = Annotated[
    PoissonArrivals | GammaArrivals | ClosedLoopArrivals | ReplayArrivals,
    Field(discriminator="process"),
]


class Workload(_Strict):
    arrivals: Arrivals
    requests: int | None = Field(
        default=None, ge=1,
        description="number of requests; default 1000, or every row of a replayed file",
    )
    prompt_tokens: LengthDist = Field(default_factory=lambda: FixedDist(dist="fixed", value=512))
    output_tokens: LengthDist = Field(default_factory=lambda: FixedDist(dist="fixed", value=256))
    seed: int = 0

    @model_validator(mode="after")
    def _enough_rows(self):
        a = self.arrivals
        if isinstance(a, ReplayArrivals) and self.requests is not None:
            rows = len(read_replay(a.file)["arrival"])
            if self.requests > rows:
                raise ValueError(
                    f"requests is {self.requests} but the arrival trace {a.file} has only "
                    f"{rows} rows: lower workload.requests or leave it out"
                )
        return self
