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

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from kestrel_sim.costs_spec import Costs, RooflineCosts, StageTime, TableCosts  # noqa: F401
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import bundled_names, load_hardware
from kestrel_sim.models import PRESETS
from kestrel_sim.profile import Profile
from kestrel_sim.quant_spec import check_quant
from kestrel_sim.schema_base import StrictModel, in_base_dir
from kestrel_sim.serving_spec import Link, Serving, Slo  # noqa: F401  (re-exported)
from kestrel_sim.speculation_spec import (  # noqa: F401  (Acceptance, Spec: re-exported)
    Acceptance,
    Spec,
    resolve_measured,
)
from kestrel_sim.validate_spec import Validate
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
)
from kestrel_sim.yamlio import load_model

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
    """A bundled hardware name, or the absolute path of a hardware YAML or Profile JSON
    (read and validated here, so its problems show at this key)."""
    if value.lower() in bundled_names():
        return value.lower()
    path = in_base_dir(value, info)
    if path.is_file():
        try:
            Profile.load(path) if path.suffix == ".json" else load_hardware(str(path))
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return str(path.resolve())
    raise ValueError(
        f"'{value}' is neither bundled hardware ({', '.join(bundled_names())}) nor a "
        f"hardware YAML / Profile JSON file (looked for {path.resolve()})"
    )


# a model or hardware field: a bundled name, or a path resolved against the scenario's folder
ModelName = Annotated[str, AfterValidator(resolve_model)]
HardwareName = Annotated[str, AfterValidator(resolve_hardware)]


# ---------------------------------------------------------------- the draft


Quant = Annotated[str, AfterValidator(check_quant), Field(
    description="projection weights quantized at load: none, int8, int4, or int4-last-N")]


class Draft(StrictModel):
    model: ModelName = Field(description="preset name or Hugging Face model folder")
    quant: Quant = Field(default="none", description="the draft's weights: none, int8, int4 or "
                         "int4-last-N; a preset draft of the target's own preset with a "
                         "quant is a quantized copy of its weights (the organic pair)")
    device: Literal["gpu", "cpu"] = "gpu"
    hardware: HardwareName | None = Field(
        default=None, description="hardware for a cpu draft (default cpu-xeon)"
    )


# ---------------------------------------------------------------- the scenario


class Scenario(StrictModel):
    name: str = "scenario"
    hardware: HardwareName = Field(
        default="h200", description="bundled name, or a hardware YAML or Profile JSON path"
    )
    model: ModelName = Field(default="qwen3-8b", description="preset or Hugging Face model folder")
    quant: Quant = "none"
    draft: Draft | None = None
    spec: Spec | None = None
    serving: Serving = Field(default_factory=Serving)
    workload: Workload
    slo: Slo = Field(default_factory=Slo)
    costs: Costs | None = None
    # `validate` in YAML and in dumps; `validate_` in Python (BaseModel has a `validate`)
    validate_: Validate = Field(
        default_factory=Validate, alias="validate",
        description="tolerances of `kestrel run --on both` (kestrel_sim.validate_spec)")

    @model_serializer(mode="wrap")
    def _dump_validate_by_its_key(self, handler):
        data = handler(self)
        if isinstance(data, dict) and "validate_" in data:
            data["validate"] = data.pop("validate_")
        return data

    @field_validator("serving")
    @classmethod
    def _budget_holds_a_batch(cls, serving: Serving, info: ValidationInfo) -> Serving:
        spec = info.data.get("spec")
        k = spec.k if spec is not None else 0
        need = serving.max_batch * (k + 1)
        if serving.max_batched_tokens < need:
            per_seq = f"{k + 1} tokens (a verify of k+1)" if k else "1 token"
            raise ValueError(
                f"max_batched_tokens is {serving.max_batched_tokens} but a full decode batch "
                f"is max_batch = {serving.max_batch} sequences of {per_seq}, {need} tokens in "
                f"one step: raise max_batched_tokens to at least {need} or lower max_batch "
                "(vLLM likewise needs max_num_batched_tokens >= max_num_seqs)")
        return serving

    @field_validator("workload")
    @classmethod
    def _fits_context(cls, workload: Workload, info: ValidationInfo) -> Workload:
        models = [m for m in (info.data.get("model"),
                              getattr(info.data.get("draft"), "model", None)) if m]
        limits = [(m, model_context(m)) for m in models]
        limits = [(m, c) for m, c in limits if c is not None]
        if not limits:
            return workload
        name, context = min(limits, key=lambda mc: mc[1])
        prompt, output = workload.longest()
        if prompt is not None and output is not None and prompt + output > context:
            raise ValueError(
                f"a request can have a {prompt}-token prompt and {output} output tokens, "
                f"{prompt + output} in all, but {name}'s context holds {context} tokens: "
                "shorten prompt_tokens or output_tokens (give normal/lognormal a max)")
        return workload

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

    @model_validator(mode="after")
    def _acceptance_from_profile(self):
        """spec.acceptance.from_profile: the measured rates of this pair, found now."""
        if self.spec is not None and self.spec.acceptance.from_profile is not False:
            self.spec.acceptance._measured = resolve_measured(self)
        return self

    @classmethod
    def load_from_dict(cls, data: dict[str, Any], base_dir: str | Path = ".") -> Scenario:
        """Validate `data`, resolving file names against `base_dir`."""
        return cls.model_validate(data, context={"base_dir": Path(base_dir)})


def model_context(model: str) -> int | None:
    """A model's context length (max_position_embeddings): its preset's, or its folder's
    config.json's; None where the config does not say."""
    if model in PRESETS:
        return PRESETS[model].max_position_embeddings
    config = json.loads((Path(model) / "config.json").read_text())
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def load_scenario(path: str | Path, overrides=()) -> Scenario:
    """A validated Scenario from a YAML file and `--set KEY=VALUE` overrides; any problem
    is one ConfigError naming the file, line and key of each."""
    return load_model(path, Scenario, overrides)


def json_schema() -> dict[str, Any]:
    """The Scenario's JSON Schema (for editors: yaml-language-server and friends)."""
    return Scenario.model_json_schema()
