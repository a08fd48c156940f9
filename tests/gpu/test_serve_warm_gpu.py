"""Serving's warm-up on a GPU captures every CUDA graph the run replays, the prefill graphs of
chunks that start mid-prompt included (a prompt of several 2048-token chunks, chunks cut by
max_batched_tokens, a recompute after a preemption): trace meta graph_captures_in_run counts
none. A continuation chunk whose graph was captured mid-run cost 110 ms on the H200 (an 8B
target: light-load-mixed-lengths), against ~5 ms replayed. Dummy qwen3-0.6b weights."""

from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from kestrel_rt.serve import serve
from kestrel_sim.scenario import Scenario


def scenario(serving: dict, speculate: bool, output=(8, 32)) -> Scenario:
    """Six prompts of 1500 to 5000 tokens (chunks at 0, 2048 and 4096), sent at once."""
    data = {"name": "gpu-serve-warm", "hardware": "h200", "model": "qwen3-0.6b",
            "serving": {"max_batch": 4, "max_batched_tokens": 4096, "prefill_chunk": 2048,
                        **serving},
            "workload": {"arrivals": {"process": "closed", "concurrency": 6, "think_time_s": 0},
                         "requests": 6,
                         "prompt_tokens": {"dist": "uniform", "low": 1500, "high": 5000},
                         "output_tokens": {"dist": "uniform", "low": output[0],
                                           "high": output[1]},
                         "seed": 0}}
    if speculate:
        data.update(draft={"model": "qwen3-0.6b", "device": "gpu"},
                    spec={"k": 4, "correction": "fused", "acceptance": {"alpha": 0.7}})
    return Scenario.load_from_dict(data)


PREEMPTED = {"kv_capacity_tokens": 12000, "on_kv_full": "preempt"}  # three prompts fill it


@pytest.mark.parametrize(("serving", "speculate", "output"), [
    ({}, True, (8, 32)),
    (PREEMPTED, False, (200, 400)),  # the simulator preempts one request of this run
], ids=["speculative", "preempted"])
def test_prompts_of_several_chunks_capture_no_graph_mid_run(serving, speculate, output):
    models = []

    def watch(engine, worker, plan):
        if not models:
            models.extend(worker.models)

    served = serve(scenario(serving, speculate, output), "cuda", observer=watch)
    trace = served.trace
    assert all(r.finish is not None for r in trace.requests)
    assert trace.meta["graph_captures_in_run"]["count"] == 0, trace.meta["graph_captures_in_run"]
    assert max(r.prompt_tokens for r in trace.requests) > 4096  # a third chunk, at 4096
    for model in models:  # prefill graphs past the first chunk's keys, warmed and replayed
        keys = {key[4] for key in model.graphs if key[1] in model.prefill_buckets}
        assert {2048, 4096} <= keys and max(keys) > 4096
        assert model.replays > 0
    if serving.get("on_kv_full") == "preempt":
        assert trace.meta["preemptions"] > 0
