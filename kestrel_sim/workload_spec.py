"""The workload part of a Scenario: arrival processes and length distributions.

Discriminated unions (`process`, `dist`) so a validation error names the right member.
Re-exported by kestrel_sim.scenario; drawn by kestrel_sim.workload.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kestrel_sim.datafiles import read_counts, read_replay
from kestrel_sim.errors import ConfigError
from kestrel_sim.schema_base import StrictModel, resolve_file

# ---------------------------------------------------------------- length distributions


class FixedDist(StrictModel):
    """Every request has `value` tokens."""

    dist: Literal["fixed"]
    value: int = Field(ge=1)

    def longest(self) -> int:
        return self.value


class UniformDist(StrictModel):
    """Integers uniform on [low, high], both included."""

    dist: Literal["uniform"]
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self):
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def longest(self) -> int:
        return self.high


class _Clipped(StrictModel):
    @model_validator(mode="after")
    def _ordered(self):
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    def longest(self) -> int | None:
        """None: no `max`, the tail is unbounded."""
        return self.max


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


class EmpiricalDist(StrictModel):
    """Values drawn with replacement from a file: integers separated by whitespace, commas or
    newlines (`#` starts a comment), or a JSON list."""

    dist: Literal["empirical"]
    file: str

    @field_validator("file")
    @classmethod
    def _exists(cls, v: str, info: ValidationInfo) -> str:
        path = resolve_file(v, info, "empirical distribution")
        try:
            read_counts(path, "empirical distribution", low=1)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return path

    def longest(self) -> int:
        return int(read_counts(self.file, "empirical distribution", low=1).max())


LengthDist = Annotated[
    FixedDist | UniformDist | NormalDist | LognormalDist | EmpiricalDist,
    Field(discriminator="dist"),
]


# ---------------------------------------------------------------- arrival processes


class PoissonArrivals(StrictModel):
    """Open loop, exponential inter-arrival times with mean 1/rate."""

    process: Literal["poisson"]
    rate: float = Field(gt=0, description="requests per second")


class GammaArrivals(StrictModel):
    """Open loop, gamma inter-arrival times: mean 1/rate, coefficient of variation `cv`
    (cv = 1 is Poisson, cv > 1 is burstier, cv < 1 smoother)."""

    process: Literal["gamma"]
    rate: float = Field(gt=0, description="requests per second")
    cv: float = Field(gt=0, description="burstiness: std/mean of inter-arrival times")


class ClosedLoopArrivals(StrictModel):
    """`concurrency` clients; each sends a request, waits for its last token, thinks
    `think_time_s`, and sends the next."""

    process: Literal["closed"]
    concurrency: int = Field(ge=1)
    think_time_s: float = Field(default=0.0, ge=0)


class ReplayArrivals(StrictModel):
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
            read_replay(path)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return path


Arrivals = Annotated[
    PoissonArrivals | GammaArrivals | ClosedLoopArrivals | ReplayArrivals,
    Field(discriminator="process"),
]


# A run draws and keeps every request: more than this takes hours and more memory than a
# workstation has (about 2,000-5,000 requests per second of wall time on one core).
MAX_REQUESTS = 10_000_000


class Workload(StrictModel):
    arrivals: Arrivals
    requests: int | None = Field(
        default=None, ge=1,
        description=f"number of requests, at most {MAX_REQUESTS:,}; default 1000, or every "
        "row of a replayed file",
    )
    prompt_tokens: LengthDist = Field(default_factory=lambda: FixedDist(dist="fixed", value=512))
    output_tokens: LengthDist = Field(default_factory=lambda: FixedDist(dist="fixed", value=256))
    seed: int = 0

    @field_validator("requests")
    @classmethod
    def _not_absurd(cls, v: int | None) -> int | None:
        if v is not None and v > MAX_REQUESTS:
            raise ValueError(too_many(v))
        return v

    @model_validator(mode="after")
    def _enough_rows(self):
        a = self.arrivals
        if isinstance(a, ReplayArrivals):
            rows = len(read_replay(a.file)["arrival"])
            if self.requests is not None and self.requests > rows:
                raise ValueError(
                    f"requests is {self.requests} but the arrival trace {a.file} has only "
                    f"{rows} rows: lower workload.requests or leave it out"
                )
            if self.requests is None and rows > MAX_REQUESTS:
                raise ValueError(f"the arrival trace {a.file} has {rows:,} rows: "
                                 + too_many(rows) + "; set workload.requests to replay the first N")
        return self

    def longest(self) -> tuple[int | None, int | None]:
        """The longest prompt and output a request can have (None: unbounded); columns of a
        replayed file override the distributions."""
        prompt, output = self.prompt_tokens.longest(), self.output_tokens.longest()
        if isinstance(self.arrivals, ReplayArrivals):
            columns = read_replay(self.arrivals.file)
            prompt = int(columns["prompt_tokens"].max()) if "prompt_tokens" in columns else prompt
            output = int(columns["output_tokens"].max()) if "output_tokens" in columns else output
        return prompt, output


def too_many(n: int) -> str:
    return (f"{n:,} requests is more than one run holds (at most {MAX_REQUESTS:,}): the "
            "simulator draws and keeps every request, and runs a few thousand per second of "
            "wall time; a steady state's metrics converge within tens of thousands")
