"""How long a calibration will take, before it starts: step times from the model's shape
and a few device constants, times the runs each point makes, plus model builds, graph
captures and (on a cold cupy cache) kernel compilation.

The constants are set from H200 measurements (docs/performance.md, issue 23): qwen3-8b
bf16 decode about 4.2 ms at batch 1 and 7 ms at batch 64, qwen3-0.6b decode about 0.75 ms,
a 512-token qwen3-8b prefill 16-35 ms; a cold kernel cache about a minute. Model builds
(dummy weights made on the GPU): qwen3-30b-a3b's 61 GB in 4.6 s, a second instance for the
pair in 5.2 s (2026-12-02), about 13 GB/s. They err long: an estimate is a budget, not a
prediction; but where they erred ten times long (builds at 1 GB/s) a --max-minutes budget
refused a 20-second calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

from calibration.grid import Point
from calibration.measure import REST_FROM_MS
from kestrel_sim.quant_spec import int4_last


@dataclass(frozen=True)
class DeviceSpeed:
    bandwidth: float  # bytes/s a step streams weights and KV at
    flops: float  # FLOP/s of a step's matmuls and attention, achieved
    step_s: float  # fixed per step
    layer_s: float  # per layer and step (launches inside a graph)
    eager_layer_s: float  # per layer, added where a step runs eagerly (host launches)
    # per MoE layer, added where a MoE step runs eagerly (past the MoE kernels' tokens: the
    # routing, sort and grouped matmuls of kestrel_rt/moe.py, ~20 torch ops of host time)
    eager_moe_layer_s: float
    build_s: float  # fixed per model build
    build_bytes_s: float  # weight bytes made or loaded per second
    point_s: float  # per point: set-up, syncs, Python


GPU = DeviceSpeed(bandwidth=4.0e12, flops=3.5e14, step_s=100e-6, layer_s=12e-6,
                  eager_layer_s=60e-6, eager_moe_layer_s=0.5e-3, build_s=5.0,
                  build_bytes_s=8.0e9, point_s=0.05)
CPU = DeviceSpeed(bandwidth=2.5e10, flops=3.0e11, step_s=2e-3, layer_s=50e-6,
                  eager_layer_s=0.0, eager_moe_layer_s=0.0, build_s=1.0,
                  build_bytes_s=1.0e9, point_s=0.01)
COLD_COMPILE_S = 60.0  # the cupy kernels of both models, on an empty kernel cache
MAX_MOE_TOKENS = 64  # kestrel_rt/cuda/moe_layer.py: tokens the MoE kernels take per call
GRAPH_CAPTURE_S = 0.1  # per captured shape, besides its eager run
QUANT_BYTES = {None: None, "none": None, "int8": 1.07, "int4": 0.57}  # per projection param


def param_counts(shape) -> tuple[float, float]:
    """(projection params, embedding + lm_head params) of a model shape (MoE: every expert)."""
    h, layers = shape.hidden_size, shape.num_hidden_layers
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    attn = 2 * h * q + 2 * h * kv
    if shape.is_moe:
        mlp = 3 * h * shape.moe_intermediate_size * shape.num_experts
    else:
        mlp = 3 * h * shape.intermediate_size
    embed = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return layers * (attn + mlp), embed


def projection_bytes(quant: str | None, layers: int) -> float | None:
    """Bytes per projection param under `quant` (int4-last-N: int4 in the last N of
    `layers`, int8 in the others, averaged), None unquantized."""
    n = int4_last(quant)
    if n is None:
        return QUANT_BYTES.get(quant)
    n = min(n, layers)
    return (n * QUANT_BYTES["int4"] + (layers - n) * QUANT_BYTES["int8"]) / layers


def weight_bytes(shape, itemsize: int, quant: str | None, read: bool = True) -> float:
    """Weight bytes a step reads (read: the projections and lm_head; the embedding only a
    row per token), or the model holds (read=False)."""
    proj, embed = param_counts(shape)
    per_param = projection_bytes(quant, shape.num_hidden_layers) or itemsize
    if read:
        embed = shape.vocab_size * shape.hidden_size
    return proj * per_param + embed * itemsize


def active_params(shape) -> float:
    """Params one token multiplies (MoE: its top-k experts), lm_head included."""
    proj, _ = param_counts(shape)
    if shape.is_moe:
        h = shape.hidden_size
        all_experts = 3 * h * shape.moe_intermediate_size * shape.num_experts
        proj -= shape.num_hidden_layers * all_experts * (
            1 - shape.num_experts_per_tok / shape.num_experts)
    return proj + shape.vocab_size * shape.hidden_size


def step_seconds(shape, speed: DeviceSpeed, itemsize: int, quant: str | None, batch: int,
                 m: int, context: int, graphed: bool) -> float:
    """A forward of batch x m new tokens at `context` cached tokens each."""
    tokens = batch * m
    kv = batch * (context + 2 * m) * shape.kv_elements_per_token * itemsize
    attn = 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim \
        * tokens * (context + m / 2)
    flops = 2 * active_params(shape) * tokens + attn
    per_layer = speed.layer_s + (0.0 if graphed else speed.eager_layer_s)
    if shape.is_moe and not graphed:
        per_layer += speed.eager_moe_layer_s
    return (speed.step_s + shape.num_hidden_layers * per_layer
            + (weight_bytes(shape, itemsize, quant) + kv) / speed.bandwidth
            + flops / speed.flops)


def point_seconds(p: Point, shape, speed: DeviceSpeed, itemsize: int, quant: str | None,
                  runs: int) -> float:
    """One point: `runs` runs (warm-up + timed) of its step, plus the fixed set-up."""
    if p.stage == "kv_transfer":
        step = 2 * p.m * shape.kv_elements_per_token * itemsize / speed.bandwidth + 20e-6
    elif p.stage == "overlap":  # the two steps at once: overlap_grid.py
        from calibration.overlap_grid import overlap_seconds

        steps = step_seconds(shape, speed, itemsize, quant, p.batch, p.m, p.context, True)
        chunk = step_seconds(shape, speed, itemsize, quant, 1, p.chunk_tokens,
                             p.chunk_context, True)
        return overlap_seconds(steps, chunk, p.timed, runs) + speed.point_s
    elif p.stage == "mixed":
        step = step_seconds(shape, speed, itemsize, quant, 1, p.batch * p.m + p.chunk_tokens,
                            p.chunk_context, graphed=False)
        step += p.batch * (p.context * shape.kv_elements_per_token * itemsize) / speed.bandwidth
    else:
        graphed = p.m <= 16 and p.batch <= 64 or p.batch == 1
        if shape.is_moe and p.batch * p.m > MAX_MOE_TOKENS:  # eager: the MoE kernels' limit
            graphed = False
        step = step_seconds(shape, speed, itemsize, quant, p.batch, p.m, p.context, graphed)
        if p.stage == "correction":
            step += step_seconds(shape, speed, itemsize, quant, p.batch, p.after_k + 1,
                                 p.context, graphed)
    if speed is GPU and p.stage != "kv_transfer" and step * 1e3 >= REST_FROM_MS:
        step *= 2  # each run followed by as long an idle (calibration/measure.py timed)
    return runs * step + speed.point_s


def spec_round_seconds(p: Point, shape, draft_shape, speed: DeviceSpeed, itemsize: int,
                       draft_itemsize: int, quant: str | None, runs: int,
                       draft_quant: str | None = None) -> float:
    """A round point (calibration/rounds.py): `runs` rounds of k = M - 1 one-token draft
    steps and a verify of M tokens per sequence, and the host's time per round."""
    from calibration.round_grid import round_seconds

    graphed = p.batch <= 64
    draft = step_seconds(draft_shape, speed, draft_itemsize, draft_quant, p.batch, 1,
                         p.context, graphed)
    verify = step_seconds(shape, speed, itemsize, quant, p.batch, p.m, p.context, graphed)
    return round_seconds(draft, verify, p.m - 1, runs) + speed.point_s


def draft_round_seconds(p: Point, shape, draft_shape, speed: DeviceSpeed,
                        draft_speed: DeviceSpeed, itemsize: int, draft_itemsize: int,
                        quant: str | None, draft_quant: str | None, runs: int) -> float:
    """A draft step point timed inside rounds (calibration/draft_rounds.py): `runs` rounds
    of DRAFT_ROUND_K draft steps (the first of M tokens) on the draft's device and a verify
    of k + 1 tokens per sequence on the target's, and the host's time per round."""
    from calibration.round_grid import DRAFT_ROUND_K, round_seconds

    k = DRAFT_ROUND_K
    gpu = draft_speed is GPU

    def draft(m: int) -> float:
        return step_seconds(draft_shape, draft_speed, draft_itemsize, draft_quant, p.batch,
                            m, p.context, gpu)

    verify = step_seconds(shape, speed, itemsize, quant, p.batch, k + 1, p.context,
                          speed is GPU)
    steps = (draft(p.m) + (k - 1) * draft(1)) / k  # round_seconds counts k alike
    return round_seconds(steps, verify, k, runs) + speed.point_s


def overlap_draft_seconds(p: Point, shape, draft_shape, speed: DeviceSpeed, itemsize: int,
                          draft_itemsize: int, quant: str | None, runs: int,
                          draft_quant: str | None = None) -> float:
    """An overlap point of the draft's one-token step beside the target's chunk
    (calibration/overlap.py)."""
    from calibration.overlap_grid import overlap_seconds

    step = step_seconds(draft_shape, speed, draft_itemsize, draft_quant, p.batch, 1,
                        p.context, True)
    chunk = step_seconds(shape, speed, itemsize, quant, 1, p.chunk_tokens, p.chunk_context,
                         True)
    return overlap_seconds(step, chunk, p.timed, runs) + speed.point_s


def build_seconds(shape, speed: DeviceSpeed, itemsize: int, quant: str | None,
                  graphs: int) -> float:
    """Building a model (weights made or read, quantized) and capturing its graphs."""
    made = weight_bytes(shape, itemsize, None, read=False) * (2 if quant not in (None, "none") else 1)
    return speed.build_s + made / speed.build_bytes_s + graphs * GRAPH_CAPTURE_S


@dataclass
class Estimate:
    builds: dict[str, float]  # bench -> seconds to build it, capture its graphs (and the
    #                           first GPU bench: compile the kernels on a cold cache)
    points: dict[str, float]  # point id -> seconds
    compile: float = 0.0  # of the builds: cold kernel compilation

    @property
    def seconds(self) -> float:
        return sum(self.builds.values()) + sum(self.points.values())

    def describe(self) -> str:
        build = sum(self.builds.values()) - self.compile
        text = (f"about {self.seconds / 60:.1f} min: {len(self.points)} points "
                f"{sum(self.points.values()) / 60:.1f} min, {len(self.builds)} model builds "
                f"and graph captures {build / 60:.1f} min")
        if self.compile:
            text += f", kernel compilation {self.compile / 60:.1f} min (cold kernel cache)"
        return text
