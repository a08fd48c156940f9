"""Stage costs fitted to a measured Profile: physical terms plus a measured correction.

Per stage and device (fit.py):

    ms = overhead + max(W * weights, F * gemm) + F * serial + K * kv + A * attention
       + correction(batch, M, context)

W, F, K, A are the step's weight bytes, gemm flops, KV bytes and attention flops counted
from the model shape (work.py), the weights at the fingerprint's quant (the target's) or
draft_quant (the draft's: draft and draft_prefill rows); the coefficients are rates,
fitted by non-negative least squares on relative error and never faster than the
device's stated rates (fit.py). The correction (correction.py) returns each measured
point's residual exactly and interpolates it between points; `correction=False` prices by
the physical terms alone (report.py gives the held-out error of both).

Fit order and borrowing: `decode` first (its context slope, ms per KV byte, is the one
every stage measured at a single context borrows: verify at c = 128, prefill at c = 0, a
draft, a correction), then `prefill` (whose attention rate a mixed stage borrows where its
rows cannot fit one), then the rest. A `correction` step is priced as `decode` when the
profile has no correction rows. A stage the scenario needs but the profile lacks is a
ConfigError naming the stage and the file.

Mixed steps (one forward carrying a decode or verify step and a prefill chunk):
  - fitted from the profile's `mixed` rows when it has them (mixed_source "fitted from
    N mixed measurements");
  - otherwise priced as the step alone plus the chunk's marginal cost on the prefill fit:
    what its flops and newly touched experts add to the roofline term, and its serial,
    KV and attention terms, without a second overhead or weight read (mixed_source "step
    + marginal chunk on the prefill fit"). describe_costs names which.
Either way the result is kept between max(step alone, chunk alone) and their sum.

Prompt chunks run one forward per chunk where the measuring runtime says so
(RuntimeInfo.chunks "per_chunk", as kestrel_rt/serve/forward.py runs them, on a GPU or
the CPU, with step graphs or without): b chunks of m
tokens are priced as b times the prefill (or draft_prefill) fit at (1, m), and a mixed
step as the step's forward and its chunks' forwards one after the other: the mixed fit
where there is one prices the step with one chunk (the shape its rows were measured at),
the other chunks each at (1, m) on the prefill fit; without it, the step alone plus each
chunk alone. Profiles without the key price a step's chunks as one [b, m] forward.

kv_transfer rows fit a link: ms = latency + bytes / bandwidth (`link()`).

overlap rows fit the contention of steps that share a device (`contention()`,
contention.py): each row's two steps are split into Shares by their stages' fits here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_sim.costs.base import BUSY, Chunk, Shares, blend
from kestrel_sim.costs.contention import Contention, OverlapRow, fit_contention, side_of
from kestrel_sim.costs.fit import stated_rates
from kestrel_sim.costs.mixed_step import mixed_step_ms, per_chunk_parts
from kestrel_sim.costs.nnls import nnls_scaled
from kestrel_sim.costs.shape import model_shape
from kestrel_sim.costs.stage_model import StageModel, fit_stage
from kestrel_sim.costs.work import DTYPE_BYTES, StepWork, bytes_per_param
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import LinkSpec, hardware_for_device
from kestrel_sim.models import ModelShape
from kestrel_sim.profile import Measurement, Profile
from kestrel_sim.runtime_info import RuntimeInfo, run_shape

FIT_ORDER = ("decode", "prefill", "verify", "correction", "draft", "mixed")


class ProfileFits:
    """Every stage of a profile fitted, per device; the shapes and rates it used."""

    def __init__(self, profile: Profile, target: ModelShape | None = None,
                 draft: ModelShape | None = None, correction: bool = True,
                 stages: tuple[str, ...] | None = None):
        fp = profile.fingerprint
        self.profile = profile
        self.target = target or _shape_of(fp.model, "model")
        kv_bytes = DTYPE_BYTES.get(fp.dtype.lower(), 2.0)
        self.works = {"target": _work(self.target, fp.dtype, fp.quant, kv_bytes)}
        if any(mm.stage == "draft" for mm in profile.measurements):
            self.draft = draft or _shape_of(fp.draft_model, "draft_model")
            # the draft's weights as measured (kestrel calibrate --draft-quant)
            self.works["draft"] = _work(self.draft, fp.dtype, fp.draft_quant, kv_bytes)
        self.correction = correction
        self.models: dict[tuple[str, str], StageModel] = {}
        devices = sorted({mm.device for mm in profile.measurements})
        # the stated rates of each device's description (read once: fit runs per row in
        # the report's leave-one-out)
        self.rates = {d: stated_rates(self.hardware(d)) for d in devices}
        for device in devices:
            for stage in FIT_ORDER:
                rows = profile.rows(stage, device)
                if rows and (stages is None or stage in stages or stage == "decode"):
                    self.models[stage, device] = self.fit(stage, device, rows)
            rows = profile.rows("draft_prefill", device)
            if rows and "draft" in self.works:
                self.models["draft_prefill", device] = self.fit("draft_prefill", device, rows)

    def work(self, stage: str) -> StepWork:
        return self.works["draft" if stage in ("draft", "draft_prefill") else "target"]

    def hardware(self, device: str):
        """The bundled description of the device the rows ran on, or None."""
        fp = self.profile.fingerprint
        if device == "gpu":
            return hardware_for_device(fp.device)
        return hardware_for_device(fp.host_cpu or fp.device)

    def borrowed(self, stage: str, device: str) -> dict[str, float]:
        got = {}
        decode = self.models.get(("decode", device))
        if stage != "decode" and decode is not None and "measured" not in decode.terms.how["kv"]:
            got["kv"] = decode.terms.kv
        prefill = self.models.get(("prefill", device))
        if stage == "mixed" and prefill is not None:
            got["attention"] = prefill.terms.attention
        return got

    def fit(self, stage: str, device: str, rows: list[Measurement],
            correction: bool | None = None) -> StageModel:
        if stage == "draft_prefill":  # the draft's prompt pass: a prefill's terms
            return fit_stage("prefill", device, rows, self.work(stage), self.rates[device], {},
                             self.correction if correction is None else correction)
        return fit_stage(stage, device, rows, self.work(stage), self.rates[device],
                         self.borrowed(stage, device),
                         self.correction if correction is None else correction)

    def link(self, between_devices: bool = True) -> LinkSpec | None:
        """The KV link fitted to kv_transfer rows (ms = latency + bytes / bandwidth), or
        None without rows that vary the size: the rows of copies between two devices
        (Measurement.link) where the profile has them and `between_devices` (disaggregated
        workers on GPUs of their own), else those within one device."""
        rows = [mm for mm in self.profile.measurements if mm.stage == "kv_transfer"]
        apart = [mm for mm in rows if mm.between_devices]
        rows = apart if apart and between_devices else [mm for mm in rows
                                                          if not mm.between_devices]
        if len({mm.bytes for mm in rows}) < 2:
            return None
        nbytes = np.array([mm.bytes for mm in rows], float)
        ms = np.array([mm.ms for mm in rows])
        a = np.column_stack([np.ones_like(ms), nbytes]) / ms[:, None]
        latency, per_byte = nnls_scaled(a, np.ones_like(ms))
        if per_byte <= 0:
            return None
        return LinkSpec(bandwidth_gb_s=1e-6 / per_byte, latency_us=latency * 1e3)


    def round_stages_ms(self, mm: Measurement, device: str = "gpu") -> float | None:
        """A `round` row's stages priced by their fits: k one-token draft steps and the
        verify of k + 1, each at its batch bucket; a plain decode round's (k = 0) decode
        step (None without those fits)."""
        k = mm.tokens_per_seq - 1
        stages = ("decode",) if k == 0 else ("draft", "verify")
        models = [self.models.get((st, device)) for st in stages]
        if None in models:
            return None
        pad = self.profile.runtime if device == "gpu" else None
        b, _ = run_shape(pad, stages[-1], mm.batch, mm.tokens_per_seq)
        if k == 0:
            return models[0].ms(b, 1, mm.context)
        draft, verify = models
        return k * draft.ms(b, 1, mm.context) + verify.ms(b, k + 1, mm.context)

    def round_rows(self, decode: bool = False, device: str = "gpu") -> list[Measurement]:
        """The profile's speculative round rows, or (decode) its plain decode rounds'."""
        return [mm for mm in self.profile.rows("round", device)
                if (mm.tokens_per_seq == 1) == decode]

    def round_overhead(self, device: str = "gpu", rows: list[Measurement] | None = None,
                       decode: bool = False) -> RoundOverhead | None:
        """What a whole speculative round (`round` rows of k >= 1, or `rows`; with decode,
        the plain decode rounds of k = 0) costs beyond its stages (round_stages_ms): the
        serving loop's host time per round, fitted as fixed ms + ms per sequence
        (non-negative least squares); None without such rows or the fits to price their
        stages."""
        rows = self.round_rows(decode, device) if rows is None else rows
        stages = [self.round_stages_ms(mm, device) for mm in rows]
        if not rows or None in stages:
            return None
        b = np.array([mm.batch for mm in rows], float)
        left = [mm.ms - st for mm, st in zip(rows, stages)]
        fixed, per_seq = nnls_scaled(np.column_stack([np.ones_like(b), b]), np.array(left))
        return RoundOverhead(float(fixed), float(per_seq), len(rows))

    def overlap_rows(self) -> list[OverlapRow]:
        """The profile's overlap rows, each step split into Shares by its stage's fit on
        the GPU (a correction by decode's); rows of a stage without a fit are left out."""
        out = []
        for mm in self.profile.rows("overlap", "gpu"):
            steps = [(mm.step_stage, mm.batch, mm.tokens_per_seq, mm.context),
                     (mm.other_stage, mm.other_batch, mm.other_tokens_per_seq,
                      mm.other_context or 0)]
            shares = [self.step_shares(*st) for st in steps]
            if None not in shares:
                timed_ms, other_ms = (self.step_ms(*st) for st in steps)
                out.append(OverlapRow(shares[0], shares[1], side_of(mm.step_stage),
                                      mm.slowdown, timed_ms, other_ms,
                                      side_of(mm.other_stage)))
        return out

    def step_ms(self, stage: str, b: int, m: int, c: int) -> float:
        """A GPU step's time alone as its stage's fit prices it (a correction by decode's;
        b prompt chunks as b forwards of one where the runtime runs them so)."""
        model = self.models.get((stage, "gpu"))
        if model is None and stage == "correction":
            model = self.models.get(("decode", "gpu"))
        runtime = self.profile.runtime
        if stage == "prefill" and runtime is not None and runtime.per_chunk:
            return b * model.ms(*run_shape(runtime, stage, 1, m), c)
        return model.ms(*run_shape(runtime, stage, b, m), c)

    def step_shares(self, stage: str, b: int, m: int, c: int) -> Shares | None:
        model = self.models.get((stage, "gpu"))
        if model is None and stage == "correction":
            model = self.models.get(("decode", "gpu"))
        runtime = self.profile.runtime
        if stage == "prefill" and runtime is not None and runtime.per_chunk:
            b = 1  # forwards of one chunk each: each uses the device as one does
        return None if model is None else model.shares(b, m, c)

    def contention(self) -> Contention:
        """lam per side fitted to the overlap rows (contention.py); the default without."""
        return fit_contention(self.overlap_rows())


@dataclass(frozen=True)
class RoundOverhead:
    """The host's time per speculative round beyond its stages: fixed_ms + per_seq_ms x
    the round's batch (ProfileFits.round_overhead)."""

    fixed_ms: float
    per_seq_ms: float
    rows: int

    def seconds(self, batch: int) -> float:
        return (self.fixed_ms + self.per_seq_ms * batch) * 1e-3

    def describe(self) -> str:
        return (f"round overhead {self.fixed_ms:.3g} ms + {self.per_seq_ms:.3g} ms per "
                f"sequence (fitted to {self.rows} round measurements)")


def _work(shape: ModelShape, dtype: str, quant: str, kv_bytes: float) -> StepWork:
    """The StepWork of `shape` with weights of `quant` (none: `dtype`'s bytes; int4-last-N:
    its layers' average) and KV elements of `kv_bytes`."""
    return StepWork(shape, bytes_per_param(dtype, quant, shape.num_hidden_layers), kv_bytes)


def _shape_of(name: str | None, key: str) -> ModelShape:
    try:
        return model_shape(name or "")
    except (ConfigError, KeyError):
        raise ConfigError(
            f"the profile's fingerprint.{key} '{name}' is neither a preset nor a model folder: "
            "give the model's shape to price its steps") from None


class FittedCost:
    """A StageCost over fitted StageModels, one per stage (see the module docstring for
    correction and mixed steps); `fallback` prices stages it lacks, if given."""

    __slots__ = ("_fallback", "_models", "mixed_source", "path", "per_chunk", "runtime")

    def __init__(self, models: dict[str, StageModel], path: str, fallback=None,
                 runtime: RuntimeInfo | None = None, per_chunk: bool | None = None):
        self.path = path
        # prompt chunks priced one forward each (RuntimeInfo.chunks); by default as
        # `runtime` says
        self.per_chunk = (runtime is not None and runtime.per_chunk if per_chunk is None
                          else per_chunk)
        # the graph buckets steps are priced at (None: none, as for a runtime without
        # step graphs)
        self.runtime = runtime if runtime is not None and runtime.graphs else None
        self._fallback = fallback
        self._models = dict(models)
        if "correction" not in self._models and "decode" in self._models:
            self._models["correction"] = self._models["decode"]
        mixed = self._models.get("mixed")
        self.mixed_source = (f"fitted from {mixed.rows} mixed measurements" if mixed
                             else "step + marginal chunk on the prefill fit")

    def has(self, stage: str) -> bool:
        return stage in self._models

    def model(self, stage: str) -> StageModel | None:
        return self._models.get(stage)

    def require(self, stages) -> None:
        missing = [s for s in stages if s not in self._models]
        if missing:
            raise ConfigError(
                f"profile {self.path} has no measurements for stage(s) {', '.join(missing)}, "
                f"which this scenario needs (it has: {', '.join(sorted(self._models))})"
            )

    def run_shape(self, stage: str, batch: int, m: float) -> tuple[int, float]:
        """(batch, m) a step runs at, as the measuring runtime pads it (Profile.runtime)."""
        return run_shape(self.runtime, stage, batch, m)

    def chunk(self, chunk: Chunk) -> Chunk:
        """A prompt chunk as it runs (its prefill graph's length)."""
        return Chunk(chunk.batch, self.run_shape("prefill", chunk.batch, chunk.m)[1],
                     chunk.context)

    def prefill_ms(self, model: StageModel, batch: float, m: float, context: float) -> float:
        """`batch` prompt chunks of `m` tokens on the prefill fit `model`, ms: `batch`
        forwards of [1, m] where the runtime runs one per chunk, else one of [batch, m]."""
        b, m = self.run_shape("prefill", batch, m)
        return batch * model.ms(1, m, context) if self.per_chunk else model.ms(b, m, context)

    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        if stage == "mixed":
            raise ValueError("a mixed step is priced by mixed_seconds: it needs its chunk")
        model = self._models.get(stage)
        if model is None:
            if self._fallback is not None:
                return self._fallback.seconds(stage, batch, m, context)
            self.require([stage])
        if stage == "prefill":
            return self.prefill_ms(model, batch, m, context) * 1e-3
        return model.ms(*self.run_shape(stage, batch, m), context) * 1e-3

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float,
                      chunk: Chunk) -> float:
        """A `stage` step carrying a prefill chunk: see the module docstring."""
        step, pre = self._models.get(stage), self._models.get("prefill")
        if step is None or pre is None:
            self.require([stage, "prefill"])
        batch, m = self.run_shape(stage, batch, m)
        return mixed_step_ms(step, pre, self._models.get("mixed"), batch, m, context,
                             self.chunk(chunk), self.per_chunk) * 1e-3


    def shares(self, stage: str, batch: int, m: float, context: float,
               chunk: Chunk | None = None) -> Shares:
        """How the step uses the device (base.Shares), from its stage's physical terms; a
        mixed forward from the mixed fit, or without one its step and chunk blended by
        their times; a stage priced by the fallback from the fallback."""
        if stage in self._models:
            batch, m = self.run_shape(stage, batch, m)
            if stage == "prefill" and self.per_chunk:  # forwards of one chunk each
                batch = 1
        if chunk is not None:
            chunk = self.chunk(chunk)
            mixed = self._models.get("mixed")
            step, pre = self._models.get(stage), self._models.get("prefill")
            if self.per_chunk and pre is not None and (mixed is not None or step is not None):
                return blend(per_chunk_parts(step, pre, mixed, batch, m, context, chunk))
            if mixed is not None:
                return mixed.shares(batch, m, context, chunk)
            if step is None or pre is None:
                return BUSY
            return blend([(step.ms(batch, m, context), step.shares(batch, m, context)),
                          (pre.ms(chunk.batch, chunk.m, chunk.context),
                           pre.shares(chunk.batch, chunk.m, chunk.context))])
        model = self._models.get(stage)
        if model is not None:
            return model.shares(batch, m, context)
        if self._fallback is not None:
            return self._fallback.shares(stage, batch, m, context)
        return BUSY


class ProfileCost(FittedCost):
    """Seconds per step from a Profile's fits (see the module docstring). `device`: the
    rows to use, "gpu" or "cpu"; by default where the profile's target stages ran. A
    draft's cost names `stages=("draft", "draft_prefill")`: its prefill is then the
    draft_prefill fit. Steps of a GPU's rows are priced at the runtime's graph bucket
    (Profile.runtime).
    `fits`: the profile's ProfileFits when already made (the shapes and correction
    arguments are then its own)."""

    __slots__ = ("device", "fits")

    def __init__(self, profile: Profile, path: str = "<profile>", fallback=None,
                 stages: tuple[str, ...] | None = None, target: ModelShape | None = None,
                 draft: ModelShape | None = None, correction: bool = True,
                 device: str | None = None, fits: ProfileFits | None = None):
        self.fits = fits or ProfileFits(profile, target, draft, correction, stages)
        self.device = device or target_device(profile)
        models = {s: m for (s, d), m in self.fits.models.items()
                  if d == self.device and (stages is None or s in stages)}
        draft_prefill = models.pop("draft_prefill", None)
        if stages is not None and "draft_prefill" in stages and draft_prefill is not None:
            models["prefill"] = draft_prefill  # the draft's cost: its prompt pass
        runtime = self.fits.profile.runtime
        # a CPU's steps pad to no graph, but its chunks run as the runtime runs them
        super().__init__(models, path, fallback, runtime if self.device == "gpu" else None,
                         runtime is not None and runtime.per_chunk)


def target_device(profile: Profile) -> str:
    """Where the profile's target stages ran: "gpu" if any ran on a GPU, else "cpu"."""
    target = [mm for mm in profile.measurements if mm.stage not in ("draft", "kv_transfer")]
    return "gpu" if any(mm.device == "gpu" for mm in target) or not target else "cpu"
