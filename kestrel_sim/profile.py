"""The Profile: measured stage costs of one model on one device, with a fingerprint.

Written by calibration (`kestrel calibrate`: kestrel_rt timing a grid of steps), read by
the simulator's profile cost model (kestrel_sim.costs.profile), which fits physical
terms to it (kestrel_sim.costs.fit) and reports their error on held-out points
(kestrel_sim.costs.report).

Schema version 2. One Measurement is one timed forward (or one KV hand-over):

  stage        prefill | decode | verify | draft | correction | mixed | kv_transfer | overlap
               | draft_prefill | round
  batch        sequences in the step (kv_transfer: requests handed over together)
  tokens_per_seq  M, new tokens per sequence (decode, draft, correction: 1; verify: k+1;
               prefill: the prompt tokens this forward carries per sequence, i.e. the
               chunk when a prompt is prefilled in chunks; mixed: the decode or verify
               part's M; kv_transfer: cached tokens sent per request)
  context      tokens already cached per sequence before the step (prefill: the part of
               the prompt prefilled by earlier chunks; 0 for a whole prompt)
  chunk_batch, chunk_tokens, chunk_context   mixed only: the prefill chunk the forward
               carries besides its decode/verify part: prompts in it, prompt tokens in
               all (the sum over its prompts), tokens already prefilled per prompt (mean)
  bytes        kv_transfer only: bytes moved
  link         kv_transfer only: the devices copied between, "cuda:0->cuda:1" (a peer copy
               between two GPUs) or "cuda:0->cuda:0" (within one); absent in older files:
               within the measuring device
  step_stage, other_stage, other_batch, other_tokens_per_seq, other_context, alone_ms
               overlap only: a step of `step_stage` (batch, tokens_per_seq, context as
               for that stage) timed while another step (`other_*`, read the same way)
               loops beside it on another stream of the same GPU, on another instance of
               the model (as the disaggregated workers on one GPU); `ms` is its time so,
               `alone_ms` its time alone, measured in the same run. A `draft` step (either
               side) is the draft model's (fingerprint.draft_model), its own instance
               beside the target's chunk, as a speculative decode worker runs it
  draft_prefill  the draft model's pass over a prompt chunk (read as prefill)
  round        one whole speculative round as serving runs it (kestrel_rt/spec SpecDecoder:
               the draft's steps, the verify, the acceptance and the host's bookkeeping
               until the next round can start), wall time: `tokens_per_seq` is k + 1 and
               the round accepts no proposal, so its first draft step feeds one token per
               sequence; what it costs beyond its stages is the serving loop's per-round
               host time (kestrel_sim.costs.profile: round_overhead)
  device       gpu | cpu: where the stage ran (a draft may run on the CPU)
  ms, samples, p10, p90   median time over `samples` timed repeats, and its spread

A chunked prefill is measured as its chunks: one prefill row per chunk, `tokens_per_seq`
the chunk and `context` the prompt tokens before it. `chunk_*` fields belong to mixed rows
only, and the overlap fields to overlap rows only, so that each row has one reading.
Overlap rows were added to version 2 without changing it (optional fields, a new stage).

`runtime` (optional) says how the runtime that measured ran its steps: kestrel_sim/
runtime_info.py. `acceptance` (optional) is the draft pair's acceptance measured on the
device (`kestrel calibrate --draft-quant ...`): kestrel_sim/measured_acceptance.py.

Version 1 files (no `schema_version`; bench/h200_decode.py wrote them) load as version 2:
the new fields take their defaults and a preset model's shape hash is derived from the
preset. `Profile.load(old).save(new)` converts one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from kestrel_sim.errors import ConfigError
from kestrel_sim.measured_acceptance import MeasuredAcceptance, combine
from kestrel_sim.quant_spec import check_quant
from kestrel_sim.runtime_info import RuntimeInfo
from kestrel_sim.yamlio import count_problems, describe_errors, key_name, read_yaml

ProfileStage = Literal["prefill", "decode", "verify", "draft", "correction", "mixed",
                       "kv_transfer", "overlap", "draft_prefill", "round"]
STEP_STAGES = ("prefill", "decode", "verify", "draft", "correction")
StepStage = Literal["prefill", "decode", "verify", "draft", "correction"]
OVERLAP_FIELDS = ("step_stage", "other_stage", "other_batch", "other_tokens_per_seq",
                  "other_context", "alone_ms")
# fingerprint fields two profiles must share for one to replace the other's rows, to be
# merged (where the draft ran and the options too), and those a flag lets differ in a merge
SAME_MODELS = ("device", "model", "model_shape_hash", "dtype", "quant", "draft_model",
               "draft_shape_hash", "draft_quant", "backend")
SAME_SETUP = SAME_MODELS + ("draft_device", "options")
VERSIONS = ("git_commit", "driver", "cuda", "torch", "cupy")


def _preset_hash(name: str | None) -> str | None:
    from kestrel_sim.models import PRESETS, shape_hash

    if name is None or name.lower() not in PRESETS:
        return None
    return shape_hash(PRESETS[name.lower()])


class Fingerprint(BaseModel):
    """Where and how the measurements were taken: enough to refuse mixing two setups."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(description="GPU name (e.g. 'NVIDIA H200') or CPU model the target ran on")
    host_cpu: str | None = Field(default=None, description="CPU model of the host")
    host_threads: int | None = Field(
        default=None, description="torch's CPU threads when measured (a CPU draft's steps "
        "scale with them); None in older files")
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    cupy: str | None = None
    git_commit: str | None = None
    date: str | None = Field(default=None, description="UTC, ISO 8601")
    model: str = Field(description="target model: a preset name or a folder's name")
    model_shape_hash: str | None = Field(
        default=None, description="kestrel_sim.models.shape_hash of the target; derived "
        "for a preset, required otherwise")
    dtype: str = "bfloat16"
    quant: Literal["none", "int8", "int4"] = "none"
    draft_model: str | None = Field(default=None, description="model the draft stage ran")
    draft_shape_hash: str | None = None
    draft_quant: Annotated[str, AfterValidator(check_quant)] = Field(
        default="none", description="the draft's weights as measured: none, int8, int4 or "
        "int4-last-N (kestrel calibrate --draft-quant; a scenario's draft.quant); files "
        "without the key: none")
    draft_device: Literal["gpu", "cpu"] | None = None
    backend: str | None = Field(default=None, description="torch | cupy | ...")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="the runtime's options, e.g. RuntimeOptions")
    grid: str | None = Field(default=None, description="name of the measured grid")

    @model_validator(mode="before")
    @classmethod
    def _derive_hashes(cls, data):
        if isinstance(data, dict):
            data = dict(data)
            if data.get("model_shape_hash") is None:
                data["model_shape_hash"] = _preset_hash(data.get("model"))
            if data.get("draft_model") and data.get("draft_shape_hash") is None:
                data["draft_shape_hash"] = _preset_hash(data["draft_model"])
            if data.get("draft_model") and data.get("draft_device") is None:
                data["draft_device"] = "gpu"
        return data

    @model_validator(mode="after")
    def _hash_known(self):
        if self.model_shape_hash is None:
            raise ValueError(
                f"model '{self.model}' is not a preset, so fingerprint.model_shape_hash is "
                "needed (kestrel_sim.models.shape_hash of its shape)")
        return self


class Measurement(BaseModel):
    """One timed step; see the module docstring for each field's reading per stage."""

    model_config = ConfigDict(extra="forbid")

    stage: ProfileStage
    batch: int = Field(ge=1)
    tokens_per_seq: int = Field(ge=1, description="M: new tokens per sequence")
    context: int = Field(default=0, ge=0, description="tokens already cached per sequence")
    chunk_batch: int | None = Field(default=None, ge=1, description="mixed: prompts in the chunk")
    chunk_tokens: int | None = Field(default=None, ge=1,
                                     description="mixed: prompt tokens the step carries")
    chunk_context: int | None = Field(default=None, ge=0,
                                      description="mixed: tokens already prefilled per prompt")
    bytes: int | None = Field(default=None, ge=1, description="kv_transfer: bytes moved")
    link: str | None = Field(
        default=None, pattern=r"^\S+->\S+$",
        description="kv_transfer: source->destination device ('cuda:0->cuda:1'); absent: "
        "within the measuring device")
    step_stage: StepStage | None = Field(default=None,
                                         description="overlap: the stage of the timed step")
    other_stage: StepStage | None = Field(
        default=None, description="overlap: the stage of the step looping beside it")
    other_batch: int | None = Field(default=None, ge=1, description="overlap: its batch")
    other_tokens_per_seq: int | None = Field(default=None, ge=1,
                                             description="overlap: its new tokens per sequence")
    other_context: int | None = Field(default=None, ge=0, description="overlap: its context")
    alone_ms: float | None = Field(default=None, gt=0,
                                   description="overlap: the timed step alone, same run")
    device: Literal["gpu", "cpu"] = "gpu"
    ms: float = Field(gt=0, description="median time")
    samples: int = Field(default=1, ge=1)
    p10: float | None = Field(default=None, gt=0)
    p90: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _fields_of_the_stage(self):
        chunk = [n for n in ("chunk_batch", "chunk_tokens", "chunk_context")
                 if getattr(self, n) is not None]
        if self.stage == "mixed" and self.chunk_tokens is None:
            raise ValueError("a mixed step needs chunk_tokens (prompt tokens it carries)")
        if self.stage != "mixed" and chunk:
            raise ValueError(f"{', '.join(chunk)} only apply to stage mixed (a chunked "
                             "prefill is one prefill row per chunk: tokens_per_seq, context)")
        overlap = [n for n in OVERLAP_FIELDS if getattr(self, n) is not None]
        missing = [n for n in OVERLAP_FIELDS if n != "other_context" and n not in overlap]
        if self.stage == "overlap" and missing:  # other_context defaults to 0
            raise ValueError(f"an overlap row needs {', '.join(missing)}")
        if self.stage != "overlap" and overlap:
            raise ValueError(f"{', '.join(overlap)} only apply to stage overlap")
        if (self.stage == "kv_transfer") != (self.bytes is not None):
            raise ValueError("bytes is needed by stage kv_transfer, and only by it")
        if self.link is not None and self.stage != "kv_transfer":
            raise ValueError("link only applies to stage kv_transfer")
        if (self.p10 is not None and self.p10 > self.ms) or (self.p90 is not None and self.p90 < self.ms):
            raise ValueError(f"expected p10 <= ms <= p90 (got {self.p10}, {self.ms}, {self.p90})")
        return self

    @property
    def slowdown(self) -> float:
        """Overlap rows: its time beside the other step over its time alone."""
        return self.ms / self.alone_ms

    @property
    def between_devices(self) -> bool:
        """A kv_transfer row of a copy from one device to another."""
        if self.link is None:
            return False
        src, dst = self.link.split("->")
        return src != dst

    @property
    def chunk(self) -> tuple[int, float, float]:
        """Mixed rows: (prompts, tokens per prompt, context per prompt) of the chunk."""
        nb = self.chunk_batch or 1
        return nb, (self.chunk_tokens or 0) / nb, float(self.chunk_context or 0)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[2] = 2
    fingerprint: Fingerprint
    runtime: RuntimeInfo | None = Field(
        default=None, description="how the measuring runtime pads steps and runs prompt "
        "chunks (module docstring)")
    measurements: list[Measurement] = Field(min_length=1)
    acceptance: MeasuredAcceptance | None = Field(
        default=None, description="the draft pair's acceptance per position, measured on "
        "the device as served (kestrel_sim/measured_acceptance.py)")
    parts: list[Fingerprint] = Field(
        default_factory=list,
        description="fingerprints of profiles merged in whose commit, date or versions "
        "differ, and of those whose rows replaced this one's (replace_rows)")

    def stages(self) -> set[str]:
        return {m.stage for m in self.measurements}

    def rows(self, stage: str, device: str = "gpu") -> list[Measurement]:
        return [m for m in self.measurements if m.stage == stage and m.device == device]

    def merge(self, other: Profile, allow_version_drift: bool = False) -> Profile:
        """One profile holding both sets of measurements (e.g. grid parts measured by
        several workers). Refused when the setups differ (device, model and its shape,
        dtype, quant, draft, backend, options; the host CPU where CPU rows are involved);
        a different commit or software version (driver, CUDA, torch, cupy) only with
        allow_version_drift. Dates may differ: parts of one grid measured apart always
        do, and the code and software, checked above, are what change the timings. The
        result keeps this profile's fingerprint; `parts` lists the other's where its date,
        grid or versions differ."""
        cpu_rows = any(m.device == "cpu" for m in self.measurements + other.measurements)
        self._refuse_other_setup(other, SAME_SETUP, cpu_rows, "merge profiles")
        a, b = self.fingerprint, other.fingerprint
        drift = [f for f in VERSIONS if getattr(a, f) != getattr(b, f)]
        if drift and not allow_version_drift:
            raise ConfigError(f"the profiles were measured by different runs "
                              f"({_differences(a, b, drift)}); merge them with "
                              "allow_version_drift=True if that is intended")
        differs = drift or a.grid != b.grid or a.date != b.date
        parts = list(self.parts) + ([b] if differs else []) + list(other.parts)
        try:
            acceptance = combine(self.acceptance, other.acceptance)
        except ValueError as err:
            raise ConfigError(f"cannot merge profiles: {err}") from None
        return Profile(fingerprint=a.model_copy(update={"grid": _both_grids(a, b)}),
                       runtime=self.runtime,
                       measurements=list(self.measurements) + list(other.measurements),
                       acceptance=acceptance, parts=parts)

    def replace_rows(self, other: Profile) -> Profile:
        """This profile with its rows of each (stage, device) pair that `other` measured
        replaced by other's (e.g. the CPU draft's steps measured again). The setups must
        match as for merge(), except where the draft ran, the options and the versions:
        `parts` records other's fingerprint, and other's benches join the options. The
        acceptance stays this profile's (other's where this has none)."""
        pairs = {(m.stage, m.device) for m in other.measurements}
        cpu_rows = any(device == "cpu" for _, device in pairs)
        self._refuse_other_setup(other, SAME_MODELS, cpu_rows, "replace rows between profiles")
        a, b = self.fingerprint, other.fingerprint
        kept = [m for m in self.measurements if (m.stage, m.device) not in pairs]
        fingerprint = a.model_copy(update={"grid": _both_grids(a, b),
                                           "options": {**a.options, **b.options}})
        return Profile(fingerprint=fingerprint, runtime=self.runtime,
                       measurements=kept + list(other.measurements),
                       acceptance=self.acceptance or other.acceptance,
                       parts=list(self.parts) + [b] + list(other.parts))

    def _refuse_other_setup(self, other: Profile, fields: tuple[str, ...], cpu_rows: bool,
                            action: str) -> None:
        """A ConfigError naming each of `fields` whose values differ (and the host CPU
        where CPU rows are involved), or the runtimes where they ran steps differently."""
        a, b = self.fingerprint, other.fingerprint
        differ = [f for f in fields if getattr(a, f) != getattr(b, f)]
        if cpu_rows and a.host_cpu != b.host_cpu:
            differ.append("host_cpu")
        if differ:
            raise ConfigError(f"cannot {action} of different setups "
                              f"({_differences(a, b, differ)}): measure both with the "
                              "same device, model, dtype, quant and draft")
        if self.runtime != other.runtime:
            raise ConfigError(f"cannot {action} whose runtimes ran steps differently "
                              f"(runtime: {self.runtime} vs {other.runtime}): step graphs "
                              "and prompt chunks must be the same")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read and validate a Profile JSON (version 1 or 2), or raise ConfigError naming
        the file, and the line (bad JSON) or line and key path (a value that does not
        validate) of each problem."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise ConfigError(f"cannot read profile {path}: {err.strerror or err}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"profile {path} is not a text (JSON) file") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"profile {path}:{err.lineno}: invalid JSON ({err.msg})") from None
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            problems = describe_errors(err, data, cls)
            where = _key_lines(path)
            lines = [f"{where(key)}{key_name(key)}: {what}" for key, what in problems]
            raise ConfigError(f"profile {path} does not validate "
                              f"({count_problems(len(lines))}):\n" + "\n".join(lines)) from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json", exclude_none=True), indent=1))
        tmp.replace(path)


def _differences(a: Fingerprint, b: Fingerprint, fields: list[str]) -> str:
    return "; ".join(f"{f}: {getattr(a, f)!r} vs {getattr(b, f)!r}" for f in fields)


def _both_grids(a: Fingerprint, b: Fingerprint) -> str | None:
    return a.grid if a.grid == b.grid else "+".join(g for g in (a.grid, b.grid) if g) or None


def _key_lines(path: Path):
    """A function: key path -> 'FILE:LINE: ' where the JSON file holds it (JSON is YAML,
    whose reader keeps lines), or '' where it cannot tell."""
    try:
        _, located = read_yaml(path)
        lines = located.lines
    except ConfigError:
        lines = {}

    def where(key: tuple) -> str:
        for n in range(len(key), 0, -1):
            if tuple(key[:n]) in lines:
                return f"{path.name}:{lines[tuple(key[:n])]}: "
        return ""
    return where
