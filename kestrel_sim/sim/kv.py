"""KV capacity: how many cached tokens one worker holds, the charge each request takes, and
the bytes per token a disaggregated prefill worker sends.

`preempt` policy: a request is charged its cached tokens (prompt + emitted) and grows as
it emits; before a round the newest requests are preempted until the round's speculative
slots (k+1 per request) fit, and recomputed later. `wait` policy: a request is charged
prompt + output + k + 1 at admission, so nothing ever needs to be evicted.
"""

from __future__ import annotations

from kestrel_sim.costs.shape import model_shape
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import Hardware
from kestrel_sim.scenario import Scenario


class KVPool:
    """Tokens of KV one worker holds: what the simulator charges, and the runtime's scheduler
    enforces (kestrel_rt/serve/kv.py) with the same rules."""

    __slots__ = ("capacity", "used")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0

    def fits(self, tokens: int) -> bool:
        return self.used + tokens <= self.capacity

    def take(self, tokens: int) -> None:
        self.used += tokens

    def give(self, tokens: int) -> None:
        self.used -= tokens


def kv_capacity(sc: Scenario, hw: Hardware | None) -> int:
    """Tokens of KV one worker holds: the scenario's number, or free memory after weights."""
    if sc.serving.kv_capacity_tokens is not None:
        return sc.serving.kv_capacity_tokens
    if hw is None:
        raise ConfigError(
            "serving.kv_capacity_tokens is needed: the hardware is a profile of a device "
            "with no bundled description, so its memory is unknown"
        )
    from kestrel_sim.costs.roofline import RooflineCost

    target = model_shape(sc.model)
    weights = RooflineCost(hw, target).weight_bytes + hw.bytes_per_param * (
        target.vocab_size * target.hidden_size  # the input embedding (read per row only)
        if not target.tie_word_embeddings else 0
    )
    per_token = hw.bytes_per_kv * target.kv_elements_per_token
    if sc.draft is not None and sc.draft.device == "gpu":
        d = model_shape(sc.draft.model)
        weights += RooflineCost(hw, d).weight_bytes
        per_token += hw.bytes_per_kv * d.kv_elements_per_token
    free = hw.memory_gb * 1e9 * sc.serving.kv_memory_fraction - weights
    if free <= 0:
        raise ConfigError(
            f"the weights ({weights / 1e9:.1f} GB) do not fit in {hw.name}'s "
            f"{hw.memory_gb} GB x kv_memory_fraction {sc.serving.kv_memory_fraction}"
        )
    return int(free // per_token)


def kv_transfer_bytes_per_token(sc: Scenario, hw: Hardware | None) -> float:
    """Bytes a prefill worker sends per cached token: the target's KV and the draft's (2-byte
    KV elements when the hardware is a profile without a bundled description)."""
    bytes_per_kv = hw.bytes_per_kv if hw else 2.0
    models = [sc.model] + ([sc.draft.model] if sc.draft is not None else [])
    return sum(bytes_per_kv * model_shape(m).kv_elements_per_token for m in models)
