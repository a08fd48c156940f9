"""One stage's fitted step time on one device: its terms over the work of its model.

    model = fit_stage(stage, device, rows, work, rates, borrowed)
    model.ms(batch, m, context)          # physical terms + measured correction
    model.physical_ms(batch, m, context) # physical terms alone
    model.shares(batch, m, context)      # how the step uses the device (base.Shares)

See fit.py for the terms and how they are fitted, correction.py for the correction.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.costs.base import Chunk, Shares, shares_of
from kestrel_sim.costs.correction import Correction
from kestrel_sim.costs.fit import (
    ATTENTION_STAGES,
    CONTEXT_ATTENTION_STAGES,
    Terms,
    fit_terms,
    step_features,
    varies_context,
)
from kestrel_sim.costs.work import StepWork
from kestrel_sim.profile import Measurement


class StageModel:
    """One stage's fitted step time on one device: the terms, the work they price, and
    the correction (None: physical terms only)."""

    __slots__ = ("_att", "_kv", "_lm", "_tok", "_w_const", "correction", "device", "rows",
                 "stage", "terms", "work")

    def __init__(self, stage: str, device: str, work: StepWork, terms: Terms,
                 correction: Correction | None, rows: int):
        self.stage, self.device, self.work, self.terms = stage, device, work, terms
        self.correction, self.rows = correction, rows
        # precomputed for the inner loop
        self._tok, self._lm = work.flops_tok, work.lm_flops
        self._kv = terms.kv * work.kv_tok
        self._att = terms.attention * work.attn_c if stage in ATTENTION_STAGES else 0.0
        self._w_const = None if work.E else terms.weights * work.w_fixed

    def physical_ms(self, b: float, m: float, c: float) -> float:
        t = b * m
        tm = self.terms
        wms = (self._w_const if self._w_const is not None
               else tm.weights * self.work.weight_bytes(t))
        f = t * self._tok + (t if self.stage == "verify" else b) * self._lm
        fms = f * tm.gemm
        return (tm.overhead + max(wms, fms) + f * tm.serial
                + self._kv * (b * c + 2.0 * t) + self._att * b * (m * c + 0.5 * m * (m + 1.0)))

    def ms(self, b: float, m: float, c: float) -> float:
        phys = self.physical_ms(b, m, c)
        if self.correction is None:
            return phys
        return max(phys + self.correction.ms((b, m), c), 0.5 * phys)

    def physical_mixed_ms(self, b: float, m: float, c: float, chunk: Chunk) -> float:
        """mixed_ms by the physical terms alone."""
        f = step_features(self.work, "mixed", b, m, c, (chunk.batch, chunk.m, chunk.context))
        return self.terms.ms(*f)

    def mixed_ms(self, b: float, m: float, c: float, chunk: Chunk) -> float:
        """A mixed stage's forward: a step of b x m at c and a prefill chunk."""
        phys = self.physical_mixed_ms(b, m, c, chunk)
        if self.correction is None:
            return phys
        return max(phys + self.correction.ms((b, m, chunk.tokens), c), 0.5 * phys)

    def shares(self, b: float, m: float, c: float, chunk: Chunk | None = None) -> Shares:
        """How the step (a mixed stage: with `chunk`) uses the device, from the physical
        terms: weights and KV are bandwidth, gemm and attention compute; the roofline max's
        larger side binds its resource, the serial term binds compute, the overhead
        neither. Fractions of the physical time (the correction is not split)."""
        tm = self.terms
        w, f, k, a = step_features(self.work, self.stage, b, m, c,
                                   None if chunk is None else tuple(chunk))
        wt, ft, kt, at, st = w * tm.weights, f * tm.gemm, k * tm.kv, a * tm.attention, f * tm.serial
        memory = (wt if wt >= ft else 0.0) + kt
        compute = (ft if ft > wt else 0.0) + st + at
        return shares_of(wt + kt, ft + at, memory, compute,
                         tm.overhead + max(wt, ft) + st + kt + at)

    def marginal_ms(self, stage: str, b: float, m: float, chunk: Chunk) -> float:
        """What a prefill chunk adds, on these (prefill) terms, to a `stage` forward of
        b x m tokens: the roofline of the weight read against the math grows by the
        chunk's flops and the experts it newly touches; its serial, KV and attention
        terms add; no second overhead."""
        tm, work = self.terms, self.work
        w0, f0, _, _ = step_features(work, stage, b, m, 0.0)
        _, fp, kp, ap = step_features(work, "prefill", chunk.batch, chunk.m, chunk.context)
        w1 = work.weight_bytes(b * m + chunk.tokens)
        return (max(w1 * tm.weights, (f0 + fp) * tm.gemm) - max(w0 * tm.weights, f0 * tm.gemm)
                + fp * tm.serial + kp * tm.kv + ap * tm.attention)


def _key(mm: Measurement) -> tuple:
    return (mm.batch, mm.tokens_per_seq, mm.chunk_tokens or 0)


def fit_stage(stage: str, device: str, rows: list[Measurement], work: StepWork,
              rates: dict[str, float], borrowed: dict[str, float],
              correction: bool = True) -> StageModel:
    """A StageModel fitted to `rows` (all of one stage and device)."""
    x = np.array([step_features(work, stage, mm.batch, mm.tokens_per_seq, mm.context,
                                mm.chunk if stage == "mixed" else None) for mm in rows])
    ms = np.array([mm.ms for mm in rows])
    varies = varies_context([_key(mm) for mm in rows],
                            [(mm.context, mm.chunk_context) for mm in rows])
    attention = stage in ATTENTION_STAGES and (varies or stage not in CONTEXT_ATTENTION_STAGES)
    terms = fit_terms(x, ms, context_varies=varies, rates=rates, borrowed=borrowed,
                      attention=attention)
    model = StageModel(stage, device, work, terms, None, len(rows))
    if correction:
        keys = np.array([_key(mm) if stage == "mixed" else _key(mm)[:2] for mm in rows], float)
        phys = np.array([model.mixed_ms(mm.batch, mm.tokens_per_seq, mm.context,
                                        Chunk(*mm.chunk)) if stage == "mixed"
                         else model.physical_ms(mm.batch, mm.tokens_per_seq, mm.context)
                         for mm in rows])
        model.correction = Correction(keys, np.array([mm.context for mm in rows], float),
                                      ms - phys)
    return model
