"""A calibration grid's points: each step `kestrel calibrate` times, and the expansion of a
grid (calibration/grid.py) into them.

    points = expand(grid, "gpu", ("gpu", "cpu"))
    points[0].id                               # "target@gpu/decode/b1/m1/c128"

`expand` turns a grid into a flat list of independent `Point`s, each with a stable id,
ordered by the model instance that measures it (its `bench`: the target, then the draft on
each device, then the pair of target instances and the target with its draft) and without
repeats (chunked prompts share chunk steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from calibration.round_grid import DRAFT_ROUND_K

if TYPE_CHECKING:
    from calibration.grid import DraftSteps, Grid, PrefillGrid


@dataclass(frozen=True)
class Point:
    """One step to time. `model`: "target" or "draft" ("pair": two instances of the target,
    "spec": the target and the draft, a round or a draft step timed inside rounds);
    `device`: "gpu" or "cpu" (where that model runs; spec: where the draft runs);
    `batch` sequences x `m` new tokens at `context` cached tokens each; mixed: plus one
    prompt chunk of `chunk_tokens` at `chunk_context`; correction: after a verify of
    `after_k` + 1 tokens; kv_transfer: `m` tokens of KV copied (batch 1, context 0), to
    another cache on the same device, or on `peer` (another GPU: "cuda:1"); round: a whole
    speculative round of k = m - 1 proposals on sequences `context` tokens long; overlap:
    the decode side's step (batch, m, context; the target's, or the draft's where
    `decode_model` is "draft") and the prefill side's chunk, `timed` the one timed."""

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
    # overlap: the model whose step the decode side runs: "target" (decode or verify, by m)
    # or "draft" (the draft model's one-token step, beside the target's chunk)
    decode_model: str = "target"

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
        if self.stage == "overlap" and self.decode_model == "draft":
            text += "/timed-draft" if self.timed == "decode" else "/timed-prefill/by-draft"
        elif self.stage == "overlap":
            text += f"/timed-{self.timed}"
        if self.stage == "correction":
            text += f"/after-k{self.after_k}"
        return text

    @property
    def catch_up(self) -> bool:
        """A draft step of M > 1: a round's first draft step as serving runs it (the tokens
        the draft has not cached, the choice after the last one only)."""
        return self.stage == "draft" and self.m > 1

    @property
    def prompt_chunk(self) -> bool:
        """A prefill step (the target's or the draft's): one forward per sequence."""
        return self.stage in ("prefill", "draft_prefill")

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
        if self.model == "spec" and self.stage == "draft":  # then the round's other steps
            return self.context + self.m + DRAFT_ROUND_K
        return self.context + self.m


def chunk_steps(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(tokens, context) of each step that prefills `prompt` tokens in chunks of `chunk`."""
    return [(min(chunk, prompt - start), start) for start in range(0, prompt, chunk)]


def prefill_points(g: PrefillGrid, model: str, device: str, stage: str) -> list[Point]:
    """Every chunk step of every prompt (repeats removed by expand)."""
    return [Point(model, device, stage, b, n, c)
            for b in g.batches for prompt in g.prompts for chunk in g.chunks
            for n, c in chunk_steps(prompt, chunk)
            if g.max_step_tokens is None or b * n <= g.max_step_tokens]


def draft_points(steps: DraftSteps | None, device: str) -> list[Point]:
    """The draft's steps (M = 1, and catch-up steps of M > 1), then its prefill chunks; steps
    timed in rounds (grid draft.cpu.timed: in_rounds) are points of the bench spec@DEVICE,
    the target with its draft (calibration/draft_rounds.py)."""
    if steps is None:
        return []
    model = "spec" if getattr(steps, "timed", "alone") == "in_rounds" else "draft"
    out = [Point(model, device, "draft", b, m, c)
           for b in steps.batches for m in steps.new_tokens for c in steps.contexts]
    if steps.prefill:
        out += prefill_points(steps.prefill, "draft", device, "draft_prefill")
    return out


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
        out += prefill_points(grid.prefill, "target", device, "prefill")
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
    the target (the bench "pair@gpu"; with a draft on the GPU too, its steps beside the
    target's chunks, on the same bench) and, with a draft on the GPU too, the whole rounds of
    the target and the draft (the bench "spec@gpu")."""
    groups = [("target", target_device, target_points(grid, target_device))]
    for device in draft_devices:
        steps = getattr(grid.draft, device, None) if grid.draft else None
        groups.append(("draft", device, draft_points(steps, device)))
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
        if "gpu" in draft_devices:  # the draft's steps beside the target's chunk
            out += [Point("pair", "gpu", "overlap", b, 1, c, n, cc, timed=timed,
                          decode_model="draft")
                    for timed, b, c, n, cc in grid.overlap.draft_shapes()]
    if grid.round and target_device == "gpu" and "gpu" in draft_devices:
        out += [Point("spec", "gpu", "round", b, m, c) for b, m, c in grid.round.shapes()]
    seen: set[str] = set()
    return [p for p in out if not (p.id in seen or seen.add(p.id))]
