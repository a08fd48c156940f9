"""Physical terms of one stage's step time, fitted to measured steps.

For a step doing W weight bytes, F gemm flops, K KV bytes and A attention flops (counted
from the model shape by work.py):

    ms = overhead + max(W * weights, F * gemm) + F * serial + K * kv + A * attention

Each coefficient is a physical rate: `weights` and `kv` are ms per byte (1 / the bandwidth
achieved reading weights, and reading and writing the KV cache), `gemm` ms per flop
(1 / the matmul rate achieved where the step is compute-bound), `attention` ms per
attention flop, `overhead` ms per forward (launches, sampling, host work). The max is the
roofline of the weight read against the math. `serial` is per-flop time that small-batch
kernels do not hide under the weight read: measured decode grows from batch 1 on
(qwen3-8b, H200, bundled profile: 4.16 ms at batch 1, 4.39 ms at batch 2) while the
weight read still dominates, where a max alone would stay flat.

The fit: non-negative least squares on relative error (each row divided by its ms), with
the max resolved by alternation: rows are called memory- or compute-bound by the current
rates (at first the device's stated rates), the linear problem is solved, and rows are
called again until no row changes side (or ITERATIONS passes). Then:
  - no rate is fitted faster than the device's hardware description states (its
    measured copy bandwidth and GEMM rate for the H200): each rate coefficient is bounded
    below by the stated one. A term with no rows to fit it (gemm when every row is
    memory-bound) stays at the stated rate.
  - weights: a dense model reads the same W at every step, so on memory-bound rows W and
    overhead are one column; it is split with W read at the stated bandwidth and the rest
    called overhead, never below 0. An MoE model's W grows with the experts a step
    touches, and there it is fitted.
  - kv: fitted only from rows that vary the context (some (b, M) at two contexts or more);
    otherwise taken from another fit (decode's, on the same device: every forward reads
    its KV at the same rate per byte), or the stated bandwidth where there is none.
    Without that rule batch effects at a fixed context are read as a context slope.
  - attention: prefill and mixed steps only (decode, draft, verify and correction read a
    few queries' KV, which `kv` prices); taken from the prefill fit where a mixed stage's
    rows cannot fit one.
  - a column the rows cannot separate from those before it (in the order overhead,
    weights, gemm, serial, kv, attention) is left out: at its stated rate, its borrowed
    value, or 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kestrel_sim.costs.nnls import nnls
from kestrel_sim.costs.work import StepWork

TERMS = ("overhead", "weights", "gemm", "serial", "kv", "attention")
RATE_TERMS = ("weights", "gemm", "kv", "attention")  # bounded by the stated rates
ATTENTION_STAGES = ("prefill", "mixed", "verify")
# stages whose attention term is fitted only from rows measured at two or more contexts
# (verify: its M x context growth, the H200's attn_partial past 8 query rows per KV head,
# cannot be told from the gemm term at one context)
CONTEXT_ATTENTION_STAGES = ("verify",)
ITERATIONS = 12


def step_features(work: StepWork, stage: str, b: float, m: float, c: float,
                  chunk: tuple[float, float, float] | None = None) -> tuple[float, ...]:
    """(W, F, K, A) of one step; a mixed step adds its chunk (prompts, tokens each,
    context each) and reads the weights once for all its tokens."""
    if stage == "mixed":
        nb, pm, pc = chunk
        inner = "decode" if m <= 1 else "verify"
        return (work.weight_bytes(b * m + nb * pm),
                work.gemm_flops(inner, b, m) + work.gemm_flops("prefill", nb, pm),
                work.kv_bytes(b, m, c) + work.kv_bytes(nb, pm, pc),
                work.attention_flops(nb, pm, pc))
    return (work.weight_bytes(b * m), work.gemm_flops(stage, b, m), work.kv_bytes(b, m, c),
            work.attention_flops(b, m, c) if stage in ATTENTION_STAGES else 0.0)


def stated_rates(hw) -> dict[str, float]:
    """A hardware description's rates as coefficients: ms per byte at its bandwidth
    (weights, kv), ms per flop at its matmul and attention peaks (gemm, attention)."""
    if hw is None:
        return {}
    per_byte = 1e3 / (hw.mem_bandwidth_tb_s * 1e12)
    apeak = hw.attention_tflops or 0.6 * hw.matmul_tflops
    return {"weights": per_byte, "kv": per_byte, "gemm": 1e3 / (hw.matmul_tflops * 1e12),
            "attention": 1e3 / (apeak * 1e12)}


@dataclass
class Terms:
    """Fitted coefficients (ms, ms/byte, ms/flop x2, ms/byte, ms/flop) and how each was set."""

    overhead: float = 0.0
    weights: float = 0.0
    gemm: float = 0.0
    serial: float = 0.0
    kv: float = 0.0
    attention: float = 0.0
    how: dict[str, str] = field(default_factory=dict)  # term -> fitted | borrowed | ...

    def ms(self, w: float, f: float, k: float, a: float) -> float:
        return (self.overhead + max(w * self.weights, f * self.gemm) + f * self.serial
                + k * self.kv + a * self.attention)


def varies_context(keys: list[tuple], contexts: list[tuple]) -> bool:
    """True where some row key (batch, M, chunk ...) was measured at two or more contexts."""
    seen: dict[tuple, tuple] = {}
    return any(seen.setdefault(k, c) != c for k, c in zip(keys, contexts))


def _independent(basis: list[np.ndarray], cand: np.ndarray) -> bool:
    """True where unit-scaled `cand` is not (numerically) in the span of `basis`."""
    if not basis:
        return True
    a = np.column_stack(basis)
    resid = cand - a @ np.linalg.lstsq(a, cand, rcond=None)[0]
    return np.linalg.norm(resid) > 1e-6


def fit_terms(x: np.ndarray, ms: np.ndarray, *, context_varies: bool,
              rates: dict[str, float], borrowed: dict[str, float],
              attention: bool) -> Terms:
    """Terms fitted to rows x = [n, (W, F, K, A)] timed `ms` = [n].

    rates: the device's stated rates (stated_rates; empty when unknown); borrowed:
    coefficients from other fits ('kv', 'attention') for terms these rows cannot fit;
    attention: whether the stage has an attention term at all."""
    w, f = x[:, 0], x[:, 1]
    weights, gemm = rates.get("weights", 0.0), rates.get("gemm", 0.0)
    memory = w * weights >= f * gemm if gemm else np.ones(len(ms), dtype=bool)
    for _ in range(ITERATIONS):
        terms = _fit_sides(x, ms, memory, context_varies, rates, borrowed, attention)
        now = w * terms.weights >= f * terms.gemm
        if (now == memory).all():
            break
        memory = now
    return terms


def _fit_sides(x, ms, memory, context_varies, rates, borrowed, attention) -> Terms:
    """One linear solve with rows split into memory-bound and compute-bound."""
    w, f, k, a = x.T
    terms = Terms()
    y = ms.copy()
    cols = {"overhead": np.ones_like(y), "weights": np.where(memory, w, 0.0),
            "gemm": np.where(memory, 0.0, f), "serial": f}
    if context_varies:
        cols["kv"] = k
    else:  # borrowed, or no faster than stated
        terms.kv = borrowed.get("kv", rates.get("kv", 0.0))
        terms.how["kv"] = ("borrowed" if "kv" in borrowed else
                           "not measured: at the stated rate" if "kv" in rates else "not measured")
        y = y - terms.kv * k
    if attention:
        cols["attention"] = a
    scale = 1.0 / ms  # relative error
    kept, unit = [], []
    for t, col in cols.items():
        col = col * scale
        norm = np.linalg.norm(col)
        if norm > 0 and _independent(unit, col / norm):
            kept.append(t)
            unit.append(col / norm)
        elif t == "attention" and "attention" in borrowed:
            terms.attention = borrowed["attention"]
            terms.how[t] = "borrowed"
            y = y - terms.attention * a
        elif t in RATE_TERMS and t in rates:
            setattr(terms, t, rates[t])
            terms.how[t] = "at the stated rate"
            if t != "weights":
                y = y - rates[t] * cols[t]
        else:
            terms.how[t] = "not separable"
    floors = {t: rates.get(t, 0.0) for t in kept if t in RATE_TERMS}
    for t, floor in floors.items():
        y = y - floor * cols[t]
    coef = nnls(np.column_stack(unit), y * scale) if kept else np.zeros(0)
    for t, c in zip(kept, coef):
        setattr(terms, t, float(c / np.linalg.norm(cols[t] * scale)) + floors.get(t, 0.0))
        terms.how[t] = "at the stated rate" if c == 0 and floors.get(t) else "fitted"
    if "weights" not in kept:
        _split_weights(terms, w, memory, rates.get("weights"))
    return terms


def _split_weights(terms: Terms, w: np.ndarray, memory: np.ndarray, rate: float | None) -> None:
    """Dense memory-bound rows: the constant holds the weight read and the overhead; read
    the weights at the stated rate (at most the whole constant), the rest is overhead."""
    wb = float(w[memory].max()) if memory.any() else float(w.max())
    if rate is None:
        terms.how["weights"] = "in overhead (device unknown)"
        return
    terms.weights = min(rate, terms.overhead / wb) if memory.any() else rate
    if memory.any():
        terms.overhead -= terms.weights * wb
    terms.how["weights"] = ("at the stated rate" if terms.weights == rate
                            else "all of the constant (faster than stated)")
