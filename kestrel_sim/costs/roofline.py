"""Analytic roofline: a step's bytes over bandwidth and flops over peak, plus overheads.

For a step of b sequences x M new tokens at context c per sequence (T = b*M tokens),
weights, gemm, kv bytes and attn are counted by work.py (StepWork) and

  seconds  = max(weights/bw, gemm/matmul_peak) + max(kv/bw, attn/attention_peak)
             + layers x kernels_per_layer x launch + step_overhead

A mixed step (a decode or verify step plus a prefill chunk in one forward) reads the
weights once, for the touched experts of all its tokens; it adds the gemm flops, KV
bytes and attention flops of both parts and pays the launch and step overheads once:

  seconds  = max(weights(T + P)/bw, (gemm + gemm_chunk)/matmul_peak)
             + max((kv + kv_chunk)/bw, (attn + attn_chunk)/attention_peak) + overheads

That single weight read (and single overhead) is what mixing saves over two steps.

`shares` splits the same terms for steps that overlap on one device (contention.py): the
weight read and KV bytes are bandwidth, gemm and attention flops compute; each max's larger
side is the time its resource binds; the overheads bind neither.
"""

from __future__ import annotations

from kestrel_sim.costs.base import Chunk, Shares, shares_of
from kestrel_sim.costs.work import StepWork, bytes_per_param
from kestrel_sim.hardware import Hardware
from kestrel_sim.models import ModelShape


class RooflineCost:
    __slots__ = (
        "_E",
        "_attn_c",
        "_expert_bytes",
        "_fixed",
        "_flops_tok",
        "_inv_apeak",
        "_inv_bw",
        "_inv_peak",
        "_keep",
        "_kv_tok",
        "_lm_flops",
        "_moe_layers",
        "_w_fixed",
        "hw",
        "shape",
    )

    def __init__(
        self, hw: Hardware, shape: ModelShape,
        launch_us: float | None = None, step_overhead_us: float | None = None,
        quant: str = "none",
    ):
        self.hw, self.shape = hw, shape
        weight_bytes = (hw.bytes_per_param if quant == "none"
                        else bytes_per_param("bfloat16", quant, shape.num_hidden_layers))
        work = StepWork(shape, weight_bytes, hw.bytes_per_kv)
        self._w_fixed = work.w_fixed
        self._expert_bytes = work.expert_bytes
        self._moe_layers = work.moe_layers
        self._E = work.E
        self._keep = work.keep
        self._flops_tok = work.flops_tok
        self._lm_flops = work.lm_flops
        self._kv_tok = work.kv_tok
        self._attn_c = work.attn_c
        layers = shape.num_hidden_layers
        self._inv_bw = 1.0 / (hw.mem_bandwidth_tb_s * 1e12)
        self._inv_peak = 1.0 / (hw.matmul_tflops * 1e12)
        apeak = hw.attention_tflops or 0.6 * hw.matmul_tflops
        self._inv_apeak = 1.0 / (apeak * 1e12)
        launch = hw.launch_us if launch_us is None else launch_us
        overhead = hw.step_overhead_us if step_overhead_us is None else step_overhead_us
        self._fixed = (layers * hw.kernels_per_layer * launch + overhead) * 1e-6

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights a one-token step reads (dense: all of them)."""
        return self._w_fixed + self._moe_layers * self._E * (1 - self._keep) * self._expert_bytes

    def touched_experts(self, tokens: float) -> float:
        """Expected distinct experts per MoE layer for `tokens` tokens routed top-k of E."""
        return self._E * (1.0 - self._keep**tokens) if self._E else 0.0

    def _weights(self, tokens: float) -> float:
        """Seconds to read the weights a forward of `tokens` tokens touches."""
        wbytes = self._w_fixed
        if self._E:
            wbytes += self._moe_layers * self._E * (1.0 - self._keep**tokens) * self._expert_bytes
        return wbytes * self._inv_bw

    def _parts(self, stage: str, batch: int, m: float, context: float):
        """(tokens, gemm s, kv s, attention s) of one stage's share of a forward."""
        t = batch * m
        logits = t if stage == "verify" else batch
        g = (t * self._flops_tok + logits * self._lm_flops) * self._inv_peak
        kvb = self._kv_tok * (batch * context + 2.0 * t) * self._inv_bw
        af = self._attn_c * batch * (m * context + 0.5 * m * (m + 1.0)) * self._inv_apeak
        return t, g, kvb, af

    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        # _weights and _parts inlined: this runs several times per simulated round
        t = batch * m
        wbytes = self._w_fixed
        if self._E:
            wbytes += self._moe_layers * self._E * (1.0 - self._keep**t) * self._expert_bytes
        logits = t if stage == "verify" else batch
        g = (t * self._flops_tok + logits * self._lm_flops) * self._inv_peak
        kvb = self._kv_tok * (batch * context + 2.0 * t) * self._inv_bw
        af = self._attn_c * batch * (m * context + 0.5 * m * (m + 1.0)) * self._inv_apeak
        return max(g, wbytes * self._inv_bw) + max(af, kvb) + self._fixed

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float,
                      chunk: Chunk) -> float:
        t, g, kvb, af = self._parts(stage, batch, m, context)
        pt, pg, pkv, paf = self._parts("prefill", chunk.batch, chunk.m, chunk.context)
        return max(g + pg, self._weights(t + pt)) + max(af + paf, kvb + pkv) + self._fixed

    def shares(self, stage: str, batch: int, m: float, context: float,
               chunk: Chunk | None = None) -> Shares:
        t, g, kvb, af = self._parts(stage, batch, m, context)
        if chunk is not None:
            pt, pg, pkv, paf = self._parts("prefill", chunk.batch, chunk.m, chunk.context)
            t, g, kvb, af = t + pt, g + pg, kvb + pkv, af + paf
        w = self._weights(t)
        memory = (w if w >= g else 0.0) + (kvb if kvb >= af else 0.0)
        compute = (g if g > w else 0.0) + (af if af > kvb else 0.0)
        return shares_of(w + kvb, g + af, memory, compute,
                         max(g, w) + max(af, kvb) + self._fixed)
