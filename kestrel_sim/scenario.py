"""The Scenario: what to run, validated once at the edge (pydantic v2, extra="forbid").

Files a scenario names (hardware YAML or Profile JSON, model folder, acceptance trace,
empirical length distribution, replayed arrivals, cost profile) are resolved against the
scenario file's folder, passed as the validation context key `base_dir`:

    Scenario.model_validate(data, context={"base_dir": Path("scenarios")})
    Scenario.load_from_dict(data, base_dir=Path("scenarios"))   # the same

A missing file is a validation error on that field naming the path. Resolved paths are
stored absolute, so a validated Scenario no longer depends on the working directory.
Times in the YAML are milliseconds (`*_ms`), microseconds (`*_us`) or seconds (`*_s`)
as their names say; rates are per second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kestrel_sim.costs_spec import Costs, RooflineCosts, StageTime, TableCosts  # noqa: F401
from kestrel_sim.datafiles import read_numbers
from kestrel_sim.errors import ConfigError
from kestrel_sim.models import PRESETS
from kestrel_sim.workload_spec import (  # noqa: F401  (re-exported: the Scenario's parts)
    Arrivals,
    ClosedLoopArrivals,
    EmpiricalDist,
    FixedDist,
    GammaArrivals,
    LengthDist,
    LognormalDist,
    NormalDist,
    PoissonArrivals,
    ReplayArrivals,
    UniformDist,
    Workload,
    _Strict,
    in_base_dir,
    resolve_file,
)

Stage = Literal["prefill", "draft", "verify", "correction", "decode"]


def resolve_model(value: str, info: ValidationInfo) -> str:
    """A preset name (lower-cased) or the absolute path of a folder with a config.json."""
    if value.lower() in PRESETS:
        return value.lower()
    path = in_base_dir(value, info)
    if (path / "config.json").is_file():
        return str(path.resolve())
    known = ", ".join(sorted(PRESETS))
    raise ValueError(
        f"'{value}' is neither a model preset ({known}) nor a folder with a config.json "
        f"(looked for {(path / 'config.json').resolve()})"
    )


def resolve_hardware(value: str, info: ValidationInfo) -> str:
    """A bundled hardware name, or the absolute path of a hardware YAML or Profile JSON."""
    from kestrel_sim.hardware import bundled_names

    if value.lower() in bundled_names():
        return value.lower()
    path = in_base_dir(value, info)
    if path.is_file():
        return str(path.resolve())
    raise ValueError(
        f"'{value}' is neither bundled hardware ({', '.join(bundled_names())}) nor a "
        f"hardware YAML / Profile JSON file (looked for {path.resolve()})"
    )


# a model or hardware field: a bundled name, or a path resolved against the scenario's folder
ModelName = Annotated[str, AfterValidator(resolve_model)]
HardwareName = Annotated[str, AfterValidator(resolve_hardware)]


# ---------------------------------------------------------------- speculative decoding


class Acceptance(_Strict):
    """Exactly one of: `alpha` (each draft token accepted with probability alpha, independent),
    `per_position` (probability that draft position i is accepted given 0..i-1 were; at
    least k entries), `trace` (a file of measured accepted lengths per round, integers
    0..k, sampled with replacement; lengths above the scenario's k count as k)."""

    alpha: float | None = Field(default=None, ge=0, le=1)
    per_position: list[Annotated[float, Field(ge=0, le=1)]] | None = None
    trace: str | None = None

    @field_validator("trace")
    @classmethod
    def _exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        path = resolve_file(v, info, "acceptance trace")
        try:
            values = read_numbers(path, "acceptance trace")
        except ConfigError as err:
            raise ValueError(str(err)) from None
        if (values < 0).any() or (values != np.rint(values)).any():
            raise ValueError(f"acceptance trace {path}: accepted lengths must be integers >= 0")
        return path

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [n for n in ("alpha", "per_position", "trace") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of alpha, per_position or trace"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self


class Spec(_Strict):
    k: int = Field(ge=1, le=64, description="draft tokens proposed per round")
    correction: Literal["separate", "fused"] = "fused"
    acceptance: Acceptance

    @model_validator(mode="after")
    def _enough_positions(self):
        pp = self.acceptance.per_position
        if pp is not None and len(pp) < self.k:
            raise ValueError(
                f"acceptance.per_position has {len(pp)} rates but k is {self.k}: give at least k"
            )
        return self


class Draft(_Strict):
    model: ModelName = Field(description="preset name or Hugging Face model folder")
    device: Literal["gpu", "cpu"] = "gpu"
    hardware: HardwareName | None = Field(
        default=None, description="hardware for a cpu draft (default cpu-xeon)"
    )


# ---------------------------------------------------------------- serving


class Link(_Strict):
    """A KV-transfer link: transfers are serialised on it (one at a time, FIFO)."""

    bandwidth_gb_s: float = Field(gt=0, description="GB/s, 1e9 bytes per second")
    latency_us: float = Field(default=0.0, ge=0)


class Serving(_Strict):
    mode: Literal["colocated", "disaggregated"] = "colocated"
    workers: int = Field(default=1, ge=1, description="colocated: GPUs doing both phases")
    prefill_workers: int = Field(default=1, ge=1, description="disaggregated only")
    decode_workers: int = Field(default=1, ge=1, description="disaggregated only")
    max_batch: int = Field(default=64, ge=1, description="sequences per decode batch")
    max_batched_tokens: int = Field(default=8192, ge=1, description="new tokens per step")
    prefill_chunk: int = Field(default=2048, ge=1, description="prompt tokens per request per step")
    prefill_schedule: Literal["mixed", "alternate"] = Field(
        default="mixed",
        description="colocated only. mixed (as vLLM's chunked prefill, Sarathi-Serve): every "
        "step is one forward that carries the running requests' decode tokens (k+1 each for "
        "a speculative verify) and fills the rest of max_batched_tokens with chunks of "
        "waiting prompts (at most prefill_chunk tokens per prompt); the k draft steps and a "
        "separate correction stay their own forwards. alternate: while prompts wait, a "
        "prefill-only step alternates with a decode or speculative round",
    )
    decode_queue: Literal["fifo"] = "fifo"
    kv_capacity_tokens: int | None = Field(
        default=None, ge=1,
        description="KV slots per worker; default: free memory after weights x kv_memory_fraction",
    )
    kv_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    on_kv_full: Literal["preempt", "wait"] = Field(
        default="preempt",
        description="preempt: evict the newest running request and recompute it later; "
        "wait: reserve prompt+output at admission so nothing is ever evicted",
    )
    link: str | Link | None = Field(
        default=None, description="KV transfer link: a name from the hardware's links or "
        "{bandwidth_gb_s, latency_us}; default the hardware's default link",
    )

    @model_validator(mode="after")
    def _mode_fields(self):
        # by value (not by "was it given"), so a dumped scenario validates again
        if self.mode == "colocated":
            odd = [f for f in ("prefill_workers", "decode_workers") if getattr(self, f) != 1]
            if odd:
                raise ValueError(
                    f"{', '.join(odd)} only apply to mode: disaggregated; "
                    "colocated mode uses `workers`"
                )
        elif self.workers != 1:
            raise ValueError(
                "`workers` only applies to mode: colocated; disaggregated mode uses "
                "prefill_workers and decode_workers"
            )
        elif self.prefill_schedule != "mixed":
            raise ValueError(
                "prefill_schedule only applies to mode: colocated; disaggregated workers "
                "never mix prefill and decode"
            )
        return self


class Slo(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)


# ---------------------------------------------------------------- the scenario


class Scenario(_Strict):
    name: str = "scenario"
    hardware: HardwareName = Field(
        default="h200", description="bundled name, or a hardware YAML or Profile JSON path"
    )
    model: ModelName = Field(default="qwen3-8b", description="preset or Hugging Face model folder")
    draft: Draft | None = None
    spec: Spec | None = None
    serving: Serving = Field(default_factory=Serving)
    workload: Workload
    slo: Slo = Field(default_factory=Slo)
    costs: Costs | None = None

    @model_validator(mode="after")
    def _spec_needs_draft(self):
        if self.spec is not None and self.draft is None:
            raise ValueError("spec is set but draft is missing: add draft: {model: ...}")
        if self.draft is not None and self.spec is None:
            raise ValueError("draft is set but spec is missing: add spec: {k: ..., acceptance: ...}")
        if self.costs is not None and self.costs.table is not None:
            t = self.costs.table
            need = ["prefill"] + (
                ["draft", "verify"] + (["correction"] if self.spec.correction == "separate" else [])
                if self.spec else ["decode"]
            )
            missing = [s for s in need if getattr(t, s) is None]
            if missing and not (missing == ["prefill"] and t.prefill_per_token is not None):
                raise ValueError(
                    f"costs.table lacks {', '.join(missing)}, needed by this scenario"
                )
        return self

    @classmethod
    def load_from_dict(cls, data: dict[str, Any], base_dir: str | Path = ".") -> Scenario:
        """Validate `data`, resolving file names against `base_dir`."""
        return cls.model_validate(data, context={"base_dir": Path(base_dir)})


def json_schema() -> dict[str, Any]:
    """The Scenario's JSON Schema (for editors: yaml-language-server and friends)."""
    return Scenario.model_json_schema()
