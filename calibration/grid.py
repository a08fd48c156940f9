"""A calibration grid: which steps `kestrel calibrate` times, read from YAML.

    grid, name = load_grid("default")          # a bundled grid (calibration/grids/NAME.yaml)
    grid, name = load_grid("my_grid.yaml")     # or a file
    points = expand(grid, "gpu", ("gpu", "cpu"))

A grid names, per stage, the values to cross (batch x new tokens x context, ...); `expand`
turns it into a flat list of independent `Point`s, each with a stable id
("target@gpu/verify/b4/m5/c2048"), ordered by the model instance that measures it (the
target, then the draft on each device) and without repeats (chunked prompts share chunk
steps). Any point can be measured alone once its model is built (calibration/measure.py), so
a later driver can spread the points of one grid over several GPUs and merge the results.

Errors name the file, line and key (kestrel_sim.yamlio, as for scenarios).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from calibration.overlap_grid import OverlapGrid
from calibration.values import MAX_K, at_most_max_k, sorted_at_least
from kestrel_sim.errors import ConfigError
from kestrel_sim.schema_base import StrictModel
from kestrel_sim.yamlio import load_model

GRIDS_DIR = Path(__file__).resolve().parent / "grids"
STAGES = ("decode", "verify", "correction", "prefill", "mixed", "draft", "kv_transfer",
          "overlap")


def _sizes(what: str, zero: bool = False):
    """A list of sizes (>= 1, or >= 0 with zero), at least one, sorted, repeats dropped."""
    low = 0 if zero else 1
    return Annotated[list[int], AfterValidator(lambda v: sorted_at_least(v, what, low))]


Batches = _sizes("batch")
Contexts = _sizes("context", zero=True)
NewTokens = _sizes("new token count")
Ks = _sizes("k")
KsOrZero = _sizes("k", zero=True)
Lengths = _sizes("length")


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


class DraftGrid(StrictModel):
    """Draft model steps (one token per sequence by default) on each device."""

    gpu: StepGrid | None = None
    cpu: StepGrid | None = None


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


@dataclass(frozen=True)
class Point:
    """One step to time. `model`: "target" or "draft"; `device`: "gpu" or "cpu" (where that
    model runs); `batch` sequences x `m` new tokens at `context` cached tokens each; mixed:
    plus one prompt chunk of `chunk_tokens` at `chunk_context`; correction: after a verify
    of `after_k` + 1 tokens; kv_transfer: `m` tokens of KV copied (batch 1, context 0), to
    another cache on the same device, or on `peer` (another GPU: "cuda:1")."""

    model: str
    device: str
    stage: str
    batch: int = 1
    m: int = 1
    context: int = 0
    chunk_tokens: int = 0
    chunk_context: int = 0
    after_k: int = 0
    peer: str = ""  # kv_transfer: the GPU the KV is copied to ("": the bench's own device)
    timed: str = ""  # overlap: "decode" or "prefill", the side timed (overlap_grid.py)

    @property
    def bench(self) -> str:
        """The model instance that measures it: "target@gpu", "draft@cpu", ..."""
        return f"{self.model}@{self.device}"

    @property
    def id(self) -> str:
        if self.stage == "kv_transfer":
            return f"{self.bench}/kv_transfer/n{self.m}" + (f"/to-{self.peer}" if self.peer
                                                            else "")
        text = f"{self.bench}/{self.stage}/b{self.batch}/m{self.m}/c{self.context}"
        if self.stage in ("mixed", "overlap"):
            text += f"/chunk{self.chunk_tokens}@{self.chunk_context}"
        if self.stage == "overlap":
            text += f"/timed-{self.timed}"
        if self.stage == "correction":
            text += f"/after-k{self.after_k}"
        return text

    @property
    def slots(self) -> int:
        """KV slots a run of it uses."""
        return self.batch + (1 if self.stage == "mixed" else 0)

    @property
    def reach(self) -> int:
        """The longest sequence it makes (cached + new tokens)."""
        if self.stage == "kv_transfer":
            return 0  # its own caches (calibration/measure.py)
        if self.stage in ("mixed", "overlap"):
            return max(self.context + self.m, self.chunk_context + self.chunk_tokens)
        if self.stage == "correction":
            return self.context + self.after_k + 1
        return self.context + self.m


def chunk_steps(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(tokens, context) of each step that prefills `prompt` tokens in chunks of `chunk`."""
    return [(min(chunk, prompt - start), start) for start in range(0, prompt, chunk)]


def target_points(grid: Grid, device: str) -> list[Point]:
    out: list[Point] = []
    add = out.append
    if grid.decode:
        for b in grid.decode.batches:
            for m in grid.decode.new_tokens:
                for c in grid.decode.contexts:
                    add(Point("target", device, "decode", b, m, c))
    if grid.verify:
        for b in grid.verify.batches:
            for k in grid.verify.k:
                for c in grid.verify.contexts:
                    add(Point("target", device, "verify", b, k + 1, c))
    if grid.correction:
        g = grid.correction
        for b in g.batches:
            for c in g.contexts:
                add(Point("target", device, "correction", b, 1, c, after_k=g.after_k))
    if grid.prefill:
        g = grid.prefill
        for b in g.batches:
            for prompt in g.prompts:
                for chunk in g.chunks:
                    for n, c in chunk_steps(prompt, chunk):
                        if g.max_step_tokens is None or b * n <= g.max_step_tokens:
                            add(Point("target", device, "prefill", b, n, c))
    if grid.mixed:
        g = grid.mixed
        for b in g.batches:
            for k in g.k:
                for c in g.contexts:
                    for n in g.chunks:
                        for cc in g.chunk_contexts:
                            add(Point("target", device, "mixed", b, k + 1, c, n, cc))
    return out


def expand(grid: Grid, target_device: str, draft_devices: tuple[str, ...] = (),
           peer: str | None = None) -> list[Point]:
    """Every point of the grid, without repeats: the target's (on target_device), then the
    draft's on each of draft_devices (those the grid's draft section lists); each model's
    kv_transfer points after its steps, and the target's to the GPU `peer` (when given and
    the grid measures between GPUs); last, on a GPU, the overlap points of two instances of
    the target (the bench "pair@gpu")."""
    groups = [("target", target_device, target_points(grid, target_device))]
    for device in draft_devices:
        steps = getattr(grid.draft, device, None) if grid.draft else None
        points = [Point("draft", device, "draft", b, m, c)
                  for b in steps.batches for m in steps.new_tokens for c in steps.contexts
                  ] if steps else []
        groups.append(("draft", device, points))
    out: list[Point] = []
    for model, device, points in groups:
        if grid.kv_transfer:
            points = points + [Point(model, device, "kv_transfer", 1, n)
                               for n in grid.kv_transfer.tokens]
            if model == "target" and peer and grid.kv_transfer.between_gpus:
                points += [Point(model, device, "kv_transfer", 1, n, peer=peer)
                           for n in grid.kv_transfer.tokens]
        out += points
    if grid.overlap and target_device == "gpu":  # two streams of one GPU
        out += [Point("pair", "gpu", "overlap", b, m, c, n, cc, timed=timed)
                for timed, b, m, c, n, cc in grid.overlap.shapes()]
    seen: set[str] = set()
    return [p for p in out if not (p.id in seen or seen.add(p.id))]


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
