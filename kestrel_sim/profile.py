"""The Profile: measured stage costs of one model on one device, with a fingerprint.

Written by calibration (kestrel_rt measuring a grid of steps), read by the simulator's
profile cost model (kestrel_sim.costs.profile). One measurement is the median time of
a step of `batch` sequences x `tokens_per_seq` new tokens at `context` tokens already
cached per sequence.

A profile measures single-stage steps only. The simulator's mixed steps (colocated
`prefill_schedule: mixed`: a decode or verify forward carrying a prefill chunk) are
priced from them as the step alone plus the chunk's marginal cost along the measured
prefill curve, kept between max(step, chunk) and step + chunk, erring high; see
kestrel_sim.costs.profile. Measuring prefill at two or more contexts lets that chunk's
attention over its already-prefilled part be fitted rather than borrowed from decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kestrel_sim.errors import ConfigError
from kestrel_sim.yamlio import count_problems, describe_errors, key_name

ProfileStage = Literal["prefill", "decode", "verify", "draft", "correction"]


class Fingerprint(BaseModel):
    """Where and how the measurements were taken."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(description="e.g. 'NVIDIA H200'")
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    backend: str | None = Field(default=None, description="torch | cupy | ...")
    model: str = Field(description="target model preset, e.g. qwen3-8b")
    draft_model: str | None = Field(default=None, description="model the draft stage ran")
    dtype: str = "bfloat16"
    date: str | None = None
    git_commit: str | None = None


class Measurement(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: ProfileStage
    batch: int = Field(ge=1)
    tokens_per_seq: int = Field(ge=1, description="M: new tokens per sequence")
    context: int = Field(ge=0, description="tokens already cached per sequence")
    ms: float = Field(gt=0, description="median step time")
    samples: int = Field(default=1, ge=1)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint: Fingerprint
    measurements: list[Measurement] = Field(min_length=1)

    def stages(self) -> set[str]:
        return {m.stage for m in self.measurements}

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read and validate a Profile JSON, or raise ConfigError naming the file, and the
        line (bad JSON) or key path (a value that does not validate) of each problem."""
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
            lines = [f"{key_name(key)}: {what}" for key, what in problems]
            raise ConfigError(f"profile {path} does not validate "
                              f"({count_problems(len(lines))}):\n" + "\n".join(lines)) from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=1))
        tmp.replace(path)
