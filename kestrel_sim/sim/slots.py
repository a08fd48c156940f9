"""Physical KV slots: how many sequences a worker's caches hold at once, planned the same way
for the runtime (kestrel_rt/serve/build.py plan_run, with the device's free memory) and the
simulator (with the hardware description's: Hardware.free_memory_gb).

The runtime's KV cache is one row of `slot_tokens` tokens per sequence in every model of a
worker (the target, and the draft when it runs beside it), plus one scratch row (a graph's
padding writes it). A worker wants `want` slots: min(max_batch, requests) colocated, and in
disaggregated mode SPARE_SLOTS_PER_BATCH x max_batch more (for KV in transit and queued);
fewer where the device's memory cannot hold them beside the weights and a workspace per
worker (workspace_bytes), never fewer than least = min(max_batch, requests) (then the run is refused).

Where slots bind: a colocated worker admits at most max_batch sequences, and holds a slot
only for those, so its slots (>= max_batch, or every request) never bind: the simulator does
not count them. A disaggregated prefill worker holds a slot from admission until its KV has
landed in a decode worker; a decode worker from the start of the transfer into it until the
request finishes or is preempted (kestrel_sim/sim/handover.py).
"""

from __future__ import annotations

import math
from collections import Counter

from kestrel_sim.costs.shape import model_shape
from kestrel_sim.errors import KestrelError
from kestrel_sim.hardware import Hardware
from kestrel_sim.models import ModelShape
from kestrel_sim.placement import placement
from kestrel_sim.scenario import Scenario

# disaggregated: slots beyond max_batch (per max_batch) for KV in transit and queued, fewer
# where the device's memory cannot hold them
SPARE_SLOTS_PER_BATCH = 1
# what a worker's activations, CUDA graph pools and kernel workspaces may take beside its
# weights and caches (kept free when its slots are planned): a quarter of its weights, at
# least 256 MB and at most 4 GB (what qwen3-8b + a qwen3-0.6b draft on an H200 gets; a
# plan that kept nothing free ran out of memory there). They grow with the model: tiny
# test models keep a few hundred MB, not 4 GB a worker of a CPU host's memory.
WORKSPACE_BYTES = 4_000_000_000
WORKSPACE_MIN_BYTES = 256_000_000
WORKSPACE_SHARE = 0.25


def workspace_bytes(weights: int) -> int:
    """The bytes a worker whose models' weights take `weights` bytes keeps free."""
    return int(min(WORKSPACE_BYTES, max(WORKSPACE_MIN_BYTES, WORKSPACE_SHARE * weights)))


def parameter_count(shape: ModelShape) -> int:
    """Parameters of `shape`'s checkpoint: every tensor kestrel_rt.weights.expected_tensors
    lists (embedding, per layer norms, attention, MLP or experts and router, final norm, an
    untied LM head)."""
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    per_layer = 2 * h + 2 * q * h + 2 * kv * h + 2 * d  # norms, q and o, k and v, q/k norms
    total = shape.vocab_size * h + h  # embedding, final norm
    for i in range(shape.num_hidden_layers):
        if shape.is_moe_layer(i):
            mlp = shape.num_experts * (h + 3 * shape.moe_intermediate_size * h)
        else:
            mlp = 3 * shape.intermediate_size * h
        total += per_layer + mlp
    if not shape.tie_word_embeddings:
        total += shape.vocab_size * h
    return total


def slot_tokens(longest: int, k: int, chunk: int, max_tokens: int) -> int:
    """Tokens per slot: the longest request (prompt + output) + k + 1, and room for a prefill
    graph's padding (a chunk padded up to its length's bucket, at most half again plus 32
    tokens, writes K/V past its own tokens: kestrel_rt/cuda/graphs.py)."""
    return longest + k + 1 + min(chunk, max_tokens, longest) // 2 + 32


def slot_range(mode: str, max_batch: int, requests: int) -> tuple[int, int]:
    """(want, least): the slots a worker wants, and the fewest it can run with."""
    spare = 0 if mode == "colocated" else SPARE_SLOTS_PER_BATCH
    return min(max_batch * (1 + spare), requests), min(max_batch, requests)


def slots_per_worker(want: int, least: int, workers: int, slot_bytes: int, weights: int,
                     free: int | None, longest: int, reserve: int = 0) -> int:
    """Slots each worker's caches get: `want`, fewer if the device's `free` bytes cannot
    hold that many next to the weights, never fewer than `least` (max_batch: refused).
    Each worker's caches hold one scratch slot more (a GraphModel's padding rows write it),
    and `reserve` bytes a worker stay free for its activations, CUDA graph pools and
    workspaces (without them a plan that filled the device ran out of memory mid-build)."""
    if free is None:
        return want
    room = free - weights - workers * reserve
    fit = room // (workers * slot_bytes) - 1 if slot_bytes else want
    if fit < least:
        raise KestrelError(
            f"the KV caches do not fit: each worker needs serving.max_batch = {least} slots of "
            f"{longest} tokens (the longest request + k + 1; the runtime's cache is one row "
            f"per sequence) and a scratch slot, {workers * (least + 1) * slot_bytes / 1e9:.1f} "
            f"GB beside {weights / 1e9:.1f} GB of weights and {workers * reserve / 1e9:.1f} GB "
            f"of workspace, but the device has {free / 1e9:.1f} GB free: "
            "lower serving.max_batch or shorten the requests"
        )
    return int(min(want, fit))


def device_slots(want: int, least: int, workers: int,
                 models: list[tuple[ModelShape, int, int]], tokens: int,
                 free: int | None) -> int:
    """Slots per worker for `workers` workers on one device, each holding `models`
    ((shape, bytes per weight, bytes per KV element) of its target, and of its draft when
    the draft runs there) with caches of `tokens` tokens per slot, in `free` bytes."""
    slot_bytes = sum(kv_b * shape.kv_elements_per_token * tokens for shape, _, kv_b in models)
    weights = sum(w_b * parameter_count(shape) for shape, w_b, _ in models)  # a worker's
    return slots_per_worker(want, least, workers, slot_bytes, workers * weights, free, tokens,
                            workspace_bytes(weights))


def free_bytes(hw: Hardware | None) -> int | None:
    """What the simulator plans slots in: the memory a process finds free on the idle device
    (free_memory_gb, else memory_gb); None where the hardware is unknown."""
    if hw is None:
        return None
    return round((hw.free_memory_gb or hw.memory_gb) * 1e9)


def simulated_slots(sc: Scenario, hw: Hardware | None, longest: int,
                    requests: int) -> tuple[int, bool]:
    """Slots per worker of a simulated run, as plan_run plans them on the hardware
    (`longest`: the longest drawn request's prompt + output tokens), and whether they fit.
    Colocated: the slots never bind (module docstring), so no memory is planned. Where
    even max_batch slots do not fit, the runtime refuses the run; the simulator (whose
    what-ifs may pass a device's memory) runs it with max_batch slots and says so (False)."""
    s = sc.serving
    want, least = slot_range(s.mode, s.max_batch, requests)
    if s.mode == "colocated":
        return want, True
    k = sc.spec.k if sc.spec else 0
    tokens = slot_tokens(longest, k, s.prefill_chunk, s.max_batched_tokens)
    kv_b = round(hw.bytes_per_kv) if hw is not None else 2
    w_b = math.ceil(hw.bytes_per_param) if hw is not None else 2
    models = [(model_shape(sc.model), w_b, kv_b)]
    if sc.draft is not None and sc.draft.device == "gpu":
        models.append((model_shape(sc.draft.model), w_b, kv_b))
    where = placement(s)  # None: a device per worker
    shared = sorted(set(Counter(where.values()).values())) if where else [1]
    free = free_bytes(hw)
    try:
        return min(device_slots(want, least, here, models, tokens, free) for here in shared), True
    except KestrelError:  # the runtime refuses this run
        return least, False
