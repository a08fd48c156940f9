"""The work one step does, counted from the model shape: bytes moved and flops.

For a step of b sequences x M new tokens at context c per sequence (T = b*M tokens):

  weights(T) = bytes_per_param x (attention + dense MLP + router params of every layer
               + 3*h*moe_inter per *touched* expert of each MoE layer + lm_head),
               read once per forward; touched experts = E*(1-(1-topk/E)^T) per MoE layer
  gemm       = 2 x T x (params each token multiplies) + 2 x logits positions x V x h
               (logits: every position for verify, the last one per sequence otherwise)
  kv bytes   = bytes_per_kv x kv elements/token x (b*c read + 2*T read and written)
  attention  = 4 x layers x heads x head_dim x b x (M*c + M*(M+1)/2)

The analytic roofline (roofline.py) divides these by a device's bandwidth and peaks; the
profile fit (fit.py) learns what each unit costs on the device that was measured.
"""

from __future__ import annotations

from kestrel_sim.models import ModelShape
from kestrel_sim.quant_spec import int4_last

# Weight bytes per parameter of a quantized checkpoint (the packed values; group scales
# add about 2-3% more, which the fitted bandwidth absorbs).
QUANT_BYTES = {"int8": 1.0, "int4": 0.5}
DTYPE_BYTES = {"bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0, "float32": 4.0,
               "fp32": 4.0}


def bytes_per_param(dtype: str, quant: str = "none", layers: int | None = None) -> float:
    """Weight bytes per parameter for a dtype and quantization ('none', 'int8', 'int4', or
    'int4-last-N': int4 in the last N of `layers` layers, int8 in the others, averaged)."""
    if quant in QUANT_BYTES:
        return QUANT_BYTES[quant]
    n = int4_last(quant)
    if n is not None and layers:
        n = min(n, layers)
        return (n * QUANT_BYTES["int4"] + (layers - n) * QUANT_BYTES["int8"]) / layers
    return DTYPE_BYTES.get(dtype.lower(), 2.0)


class StepWork:
    """Bytes and flops of a step of a model, for given weight and KV element sizes."""

    __slots__ = (
        "E",
        "attn_c",
        "expert_bytes",
        "flops_tok",
        "keep",
        "kv_tok",
        "lm_flops",
        "moe_layers",
        "shape",
        "w_fixed",
    )

    def __init__(self, shape: ModelShape, bytes_per_param: float = 2.0,
                 bytes_per_kv: float = 2.0):
        self.shape = s = shape
        h, layers = s.hidden_size, s.num_hidden_layers
        q = s.num_attention_heads * s.head_dim
        kv = s.num_key_value_heads * s.head_dim
        attn = h * q + 2 * h * kv + q * h
        moe_layers = sum(1 for i in range(layers) if s.is_moe_layer(i))
        dense_layers = layers - moe_layers
        mlp = 3 * h * s.intermediate_size
        expert = 3 * h * s.moe_intermediate_size
        router = h * s.num_experts
        lm = s.vocab_size * h
        self.w_fixed = bytes_per_param * (
            layers * attn + dense_layers * mlp + moe_layers * router + lm)
        self.expert_bytes = bytes_per_param * expert
        self.moe_layers = moe_layers
        self.E = s.num_experts
        self.keep = 1.0 - s.num_experts_per_tok / s.num_experts if s.is_moe else 1.0
        self.flops_tok = 2.0 * (layers * attn + dense_layers * mlp
                                + moe_layers * (router + s.num_experts_per_tok * expert))
        self.lm_flops = 2.0 * lm
        self.kv_tok = bytes_per_kv * s.kv_elements_per_token
        self.attn_c = 4.0 * layers * q

    def weight_bytes(self, tokens: float) -> float:
        """Bytes of weights a forward of `tokens` tokens reads (MoE: the touched experts)."""
        if not self.E:
            return self.w_fixed
        return self.w_fixed + self.moe_layers * self.E * (1.0 - self.keep**tokens) * self.expert_bytes

    def gemm_flops(self, stage: str, batch: float, m: float) -> float:
        logits = batch * m if stage == "verify" else batch
        return batch * m * self.flops_tok + logits * self.lm_flops

    def kv_bytes(self, batch: float, m: float, context: float) -> float:
        return self.kv_tok * (batch * context + 2.0 * batch * m)

    def attention_flops(self, batch: float, m: float, context: float) -> float:
        return self.attn_c * batch * (m * context + 0.5 * m * (m + 1.0))
