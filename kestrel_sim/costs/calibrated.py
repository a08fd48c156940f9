"""A roofline calibrated on hardware that was measured, applied to hardware that was not.

A profile's fitted terms (fit.py) are rates: ms per weight byte, per gemm flop (in the
roofline max and serial), per KV byte, per attention flop, and ms per forward of
overhead. Against the rates the measured device's hardware description states, each is an
efficiency: the fraction of the stated bandwidth, matmul or attention rate the runtime
achieves. Those efficiencies are carried to device B, whose description (a datasheet in
a hardware YAML) gives its own rates:

    weights_B   = weights_A   x bandwidth_A / bandwidth_B        (same fraction of B's)
    kv_B        = kv_A        x bandwidth_A / bandwidth_B
    gemm_B      = gemm_A      x matmul_A / matmul_B;  serial_B likewise
    attention_B = attention_A x attention_A_rate / attention_B_rate
    overhead_B  = overhead_A  x layers / layers measured   (host and launch work: not
                                                              scaled by the device)

and B's step times are priced with the physical terms alone (the measured correction
belongs to A's kernels), each step at the runtime's graph bucket as on A (Profile.runtime),
a step's prompt chunks one forward each where that runtime runs them so (RuntimeInfo.chunks);
the serving loop's host time per round (ProfileFits.round_overhead) is carried as measured. On A itself this is the profile's physical fit, whose held-out
error report.py gives. The model priced may differ from the one measured (the same
efficiencies over another shape, overhead scaled by its layers); its dtype and quant are
the profile's. A draft whose model the profile did not measure is priced with the
target's decode terms (and its prompt pass with the prefill terms), its weights
unquantized; one it measured, with its own draft and draft_prefill terms, its weights at
the profile's draft_quant (as they were fitted: profile.py).
"""

from __future__ import annotations

from kestrel_sim.costs.fit import RATE_TERMS, Terms, stated_rates
from kestrel_sim.costs.profile import FittedCost, ProfileFits
from kestrel_sim.costs.stage_model import StageModel
from kestrel_sim.costs.work import DTYPE_BYTES, StepWork, bytes_per_param
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import Hardware
from kestrel_sim.models import ModelShape

SCALED_BY = {"weights": "weights", "kv": "kv", "gemm": "gemm", "serial": "gemm",
             "attention": "attention"}  # term -> the stated rate its ratio comes from


def efficiencies(terms: Terms, hw: Hardware) -> dict[str, float]:
    """Fraction of hw's stated rate each rate term achieves (1 = as stated)."""
    rates = stated_rates(hw)
    return {t: rates[t] / getattr(terms, t) for t in RATE_TERMS if getattr(terms, t) > 0}


def move_terms(terms: Terms, measured_on: Hardware, on: Hardware, layer_ratio: float) -> Terms:
    """`terms` fitted on `measured_on`, at the same efficiencies on `on`."""
    a, b = stated_rates(measured_on), stated_rates(on)
    moved = {t: getattr(terms, t) * b[SCALED_BY[t]] / a[SCALED_BY[t]] for t in SCALED_BY}
    return Terms(overhead=terms.overhead * layer_ratio, how=dict(terms.how), **moved)


class CalibratedRoofline(FittedCost):
    """Stage costs of `shape` on `on`, from a profile's fits measured on `measured_on`."""

    __slots__ = ("measured_on", "on", "source_models")

    def __init__(self, fits: ProfileFits, measured_on: Hardware, on: Hardware,
                 shape: ModelShape, path: str, role: str = "target", fallback=None):
        self.measured_on, self.on = measured_on, on
        fp = fits.profile.fingerprint
        kv_bytes = DTYPE_BYTES.get(fp.dtype.lower(), 2.0)
        gpu = {s: m for (s, d), m in fits.models.items() if d == "gpu"}
        if "decode" not in gpu:
            raise ConfigError(f"profile {path} has no decode measurements on a GPU, so it "
                              "cannot calibrate a roofline: measure decode")
        quant = fp.quant
        if role == "draft":
            # the draft's own rows if they measured this shape (its weights as measured:
            # draft_quant), else the target's decode over an unquantized draft
            same = "draft" in gpu and fits.works["draft"].shape == shape
            quant = fp.draft_quant if same else "none"
            picked = {"draft": gpu["draft" if same else "decode"],
                      "prefill": gpu.get("draft_prefill" if same and "draft_prefill" in gpu
                                         else "prefill")}
        else:
            picked = {s: m for s, m in gpu.items() if s not in ("draft", "draft_prefill")}
        self.source_models = {s: m for s, m in picked.items() if m is not None}
        work = StepWork(shape, bytes_per_param(fp.dtype, quant, shape.num_hidden_layers),
                        kv_bytes)
        models = {}
        for stage, fitted in self.source_models.items():
            ratio = shape.num_hidden_layers / fitted.work.shape.num_hidden_layers
            terms = move_terms(fitted.terms, measured_on, on, ratio)
            models[stage] = StageModel(stage, "gpu", work, terms, None, fitted.rows)
        # the same runtime runs on B: its steps padded to the same graph buckets, its
        # prompt chunks run as on A (one forward each, or batched)
        super().__init__(models, path, fallback, fits.profile.runtime)

    def efficiencies(self) -> dict[str, dict[str, float]]:
        """Per stage: the fraction of each stated rate achieved (the same on both devices)."""
        return {s: efficiencies(m.terms, self.measured_on) for s, m in self.source_models.items()}
