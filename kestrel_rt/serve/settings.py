"""The serving constants of a Scenario, resolved once (as the simulator's StepConfig), and the
serving keys the runtime cannot honour, refused with the key named.

The rules they drive are the simulator's (kestrel_sim/sim/steps.py, processes.py, kv.py):
max_batch sequences per worker (prefilling + running), max_batched_tokens new tokens per
step (decode or verify tokens first, prompt chunks get the rest), prefill_chunk tokens per
prompt per step, a logical KV budget of kv_capacity_tokens per worker charged as KVPool is.
"""

from __future__ import annotations

from dataclasses import dataclass

from kestrel_sim.errors import ConfigError, KestrelError
from kestrel_sim.scenario import Scenario


class UnsupportedScenarioError(KestrelError):
    """A scenario key the runtime cannot honour on this machine."""


@dataclass(frozen=True, slots=True)
class ServeSettings:
    mode: str  # colocated | disaggregated
    max_batch: int
    max_tokens: int  # serving.max_batched_tokens
    chunk: int  # serving.prefill_chunk
    mixed: bool  # colocated and prefill_schedule mixed: chunks ride in decode/verify forwards
    preempt: bool  # on_kv_full: preempt (True) or wait (False)
    decode_order: str  # fifo | shortest-first (the disaggregated decode queue)
    kv_capacity: int  # logical KV tokens per worker
    k: int  # draft tokens per speculative round; 0 without speculation


def refuse_unsupported(sc: Scenario) -> None:
    """Raise UnsupportedScenarioError for scenario keys the runtime cannot run (any number of
    workers runs: placement.py puts them on devices, and refuses devices it lacks)."""
    if (sc.spec is not None and sc.spec.acceptance.trace is not None
            and sc.spec.acceptance.on_hardware != "organic"):
        raise UnsupportedScenarioError(
            f"spec.acceptance.trace ({sc.spec.acceptance.trace}) is not supported on hardware: "
            "controlled acceptance takes spec.acceptance.alpha or per_position; give one of "
            "those, set spec.acceptance.on_hardware: organic (the target accepts for real), "
            "or run the trace on the simulator (--on sim)"
        )


def check_lengths(model: str, prompt_max: int, output_max: int, k: int, context: int,
                  capacity: int) -> None:
    """Refuse a workload whose longest request does not fit the model's context (its last
    verify writes up to position prompt + output + k - 2) or a worker's KV budget (prompt +
    output + k + 1, refused by the simulator the same way)."""
    if prompt_max + output_max + k > context:
        raise ConfigError(
            f"a request of {prompt_max} prompt and {output_max} output tokens with k = {k} "
            f"needs {prompt_max + output_max + k} positions but model {model} has a context "
            f"of {context} (max_position_embeddings): shorten workload.prompt_tokens or "
            "workload.output_tokens"
        )
    worst = prompt_max + output_max + k + 1
    if worst > capacity:
        raise ConfigError(
            f"a request needs {worst} KV tokens (prompt + output + k + 1) but a worker holds "
            f"{capacity} (serving.kv_capacity_tokens): raise it or shorten the requests"
        )


def serve_settings(sc: Scenario, kv_capacity: int) -> ServeSettings:
    refuse_unsupported(sc)
    sv = sc.serving
    return ServeSettings(
        mode=sv.mode,
        max_batch=sv.max_batch,
        max_tokens=sv.max_batched_tokens,
        chunk=sv.prefill_chunk,
        mixed=sv.mode == "colocated" and sv.prefill_schedule == "mixed",
        preempt=sv.on_kv_full == "preempt",
        decode_order=sv.decode_queue,
        kv_capacity=kv_capacity,
        k=sc.spec.k if sc.spec else 0,
    )
