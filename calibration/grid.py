"""A calibration grid: which steps `kestrel calibrate` times, read from YAML.

    grid, name = load_grid("default")          # a bundled grid (calibration/grids/NAME.yaml)
    grid, name = load_grid("my_grid.yaml")     # or a file
    points = expand(grid, "gpu", ("gpu", "cpu"))

A grid names, per stage, the values to cross (batch x new tokens x context, ...); `expand`
(calibration/points.py, also importable from here) turns it into a flat list of independent
`Point`s, each with a stable id ("target@gpu/verify/b4/m5/c2048"), ordered by the model
instance that measures it (the target, then the draft on each device) and without repeats
(chunked prompts share chunk steps). Any point can be measured alone once its model is
built (calibration/measure.py), so a driver can spread the points of one grid over several
GPUs and merge the results.

Errors name the file, line and key (kestrel_sim.yamlio, as for scenarios).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from calibration.overlap_grid import OverlapGrid
from calibration.points import Point, chunk_steps, expand  # the grid's API
from calibration.round_grid import RoundGrid
from calibration.values import (
    MAX_K,
    Batches,
    Contexts,
    Ks,
    KsOrZero,
    Lengths,
    NewTokens,
    at_most_max_k,
)
from kestrel_sim.errors import ConfigError
from kestrel_sim.schema_base import StrictModel
from kestrel_sim.yamlio import load_model

__all__ = ["Grid", "Point", "bundled_grids", "chunk_steps", "expand", "load_grid"]

GRIDS_DIR = Path(__file__).resolve().parent / "grids"
STAGES = ("decode", "verify", "correction", "prefill", "mixed", "draft", "draft_prefill",
          "kv_transfer", "overlap", "round")


class Timing(StrictModel):
    """Runs per point: warm-up runs (not timed: graph capture, kernel compile, caches) then
    timed repetitions, of which the median is the point's time."""

    warmup: int = Field(default=2, ge=1, description="untimed runs before the timed ones (GPU)")
    repeats: int = Field(default=7, ge=1, description="timed runs per point (GPU)")
    cpu_warmup: int = Field(default=1, ge=1, description="untimed runs per point (CPU)")
    cpu_repeats: int = Field(default=3, ge=1, description="timed runs per point (CPU)")


class StepGrid(StrictModel):
    """Steps of `batches` sequences x `new_tokens` each, at `contexts` cached tokens."""

    batches: Batches
    contexts: Contexts = Field(description="tokens already cached per sequence")
    new_tokens: NewTokens = Field(default=[1], description="M: new tokens "
                                                  "per sequence")


class VerifyGrid(StrictModel):
    """Target forwards of k + 1 tokens per sequence (the verify of k proposals)."""

    batches: Batches
    k: Ks = Field(description=f"proposals per round, 1..{MAX_K} (M = k + 1)")
    contexts: Contexts

    @field_validator("k")
    @classmethod
    def _k(cls, v: list[int]) -> list[int]:
        return at_most_max_k(v)


class CorrectionGrid(StrictModel):
    """A one-token target forward right after a verify of k + 1 tokens (separate
    correction): decode at the verify's context, timed alone."""

    batches: Batches
    contexts: Contexts
    after_k: int = Field(default=4, ge=1, le=MAX_K, description="k of the verify before it")


class PrefillGrid(StrictModel):
    """Prompts of `prompts` tokens for `batches` sequences at once, each prefilled in chunks
    of C tokens for C in `chunks` (a chunk >= the prompt: the whole prompt in one step). Every
    chunk step is a point: C tokens per sequence at the context the earlier chunks left."""

    batches: Batches
    prompts: Lengths
    chunks: Lengths
    max_step_tokens: int | None = Field(
        default=None, ge=1, description="leave out steps of more tokens (batch x chunk)")


class MixedGrid(StrictModel):
    """One forward carrying `batches` running sequences (decode: k = 0, M = 1; verify: M =
    k + 1) at `contexts`, plus one prompt chunk of `chunks` tokens at `chunk_contexts`."""

    batches: Batches
    k: KsOrZero = Field(description="0: decode rows; k >= 1: verify rows of "
                                      "k + 1 tokens")
    contexts: Contexts
    chunks: Lengths
    chunk_contexts: Contexts

    @field_validator("k")
    @classmethod
    def _k(cls, v: list[int]) -> list[int]:
        return at_most_max_k(v)


class DraftSteps(StepGrid):
    """The draft's steps on one device: `new_tokens` M = 1 a plain one-token step, M > 1
    the first step of a serving round (the catch-up: the tokens the draft has not cached,
    its last token's choice only); and its `prefill`, the prompt chunks as the target's."""

    prefill: PrefillGrid | None = Field(default=None, description="the draft's pass over "
                                        "the prompts (stage draft_prefill)")


class CpuDraftSteps(DraftSteps):
    """The draft's steps on the host CPU. `timed: alone` times each step back to back on a
    host that runs nothing else; `in_rounds` times it where serving runs it, inside
    speculative rounds whose verify runs on the target's device between the draft's steps
    (calibration/draft_rounds.py): the serving process's host, the GPU's wait and the round
    loop around each step."""

    timed: Literal["alone", "in_rounds"] = Field(
        default="alone", description="alone: each step back to back; in_rounds: each step "
        "inside speculative rounds with the target verifying (bench spec@cpu)")


class DraftGrid(StrictModel):
    """Draft model steps (one token per sequence by default) on each device."""

    gpu: DraftSteps | None = None
    cpu: CpuDraftSteps | None = None


class TransferGrid(StrictModel):
    """KV hand-over: the rows of `tokens` tokens copied from one cache to another, within
    each model instance's device, and from the target's GPU to a second GPU (the link
    between GPUs that disaggregated workers on two GPUs cross) where the machine has one."""

    tokens: Lengths
    between_gpus: bool = Field(
        default=True, description="also measure the copy to a second GPU (skipped, with a "
        "note, on a machine with one)")


class Grid(StrictModel):
    """What `kestrel calibrate` measures; a stage left out is not measured."""

    name: str | None = Field(default=None, description="defaults to the file's name")
    timing: Timing = Timing()
    decode: StepGrid | None = None
    verify: VerifyGrid | None = None
    correction: CorrectionGrid | None = None
    prefill: PrefillGrid | None = None
    mixed: MixedGrid | None = None
    draft: DraftGrid | None = None
    kv_transfer: TransferGrid | None = None
    overlap: OverlapGrid | None = Field(
        default=None, description="the two disaggregated workers' steps at once on one GPU "
        "(calibration/overlap_grid.py); measured on a GPU only")
    round: RoundGrid | None = Field(
        default=None, description="whole speculative rounds, the target and the draft on a "
        "GPU (calibration/round_grid.py); measured on a GPU only")


def bundled_grids() -> list[str]:
    return sorted(p.stem for p in GRIDS_DIR.glob("*.yaml"))


def load_grid(name_or_path: str | Path) -> tuple[Grid, str]:
    """(grid, its name) from a bundled grid's name or a YAML file; ConfigError if it does
    not validate (file, line, key) or cannot be found."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not path.suffix and not path.exists() and "/" not in text:
        path = GRIDS_DIR / f"{text}.yaml"
        if not path.is_file():
            raise ConfigError(f"--grid '{text}' is neither a file nor a bundled grid: expected "
                              f"one of {', '.join(bundled_grids())} or a path to a YAML file")
    elif not path.is_file():
        raise ConfigError(f"grid file {path} not found (looked for {path.resolve()})")
    grid = load_model(path, Grid)
    return grid, grid.name or path.stem
