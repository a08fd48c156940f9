"""The serving engine on one GPU with the presets of issue 24 (dummy weights): a qwen3-8b
target with a qwen3-0.6b draft under controlled acceptance, the organic pair (qwen3-0.6b and
its int4-last-14 copy) accepting for real, plain and disaggregated serving; every request
finishes, every stage is traced, and greedy serving gives plain greedy generation's tokens
(fp32, where the batch a request lands in does not move an argmax)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from kestrel_rt.engine import generate
from kestrel_rt.runner import build_model
from kestrel_rt.serve import serve
from kestrel_sim.metrics import compute_metrics
from kestrel_sim.scenario import Scenario


def scenario(model: str, serving: dict, requests: int = 8, draft: dict | None = None,
             spec: dict | None = None, prompt=(32, 200), output=(8, 40)) -> Scenario:
    data = {"name": "gpu-serve", "hardware": "h200", "model": model, "serving": serving,
            "workload": {"arrivals": {"process": "closed", "concurrency": requests},
                         "requests": requests,
                         "prompt_tokens": {"dist": "uniform", "low": prompt[0], "high": prompt[1]},
                         "output_tokens": {"dist": "uniform", "low": output[0], "high": output[1]},
                         "seed": 0}}
    if draft is not None:
        data.update(draft=draft, spec=spec)
    return Scenario.load_from_dict(data)


def plain_greedy(model_name: str, served, dtype) -> list[list[int]]:
    target = build_model(model_name, "cuda", dtype)
    lengths = [len(o) for o in served.outputs]
    return [generate(target, [p], n).token_ids[0] for p, n in zip(served.prompts, lengths)]


def test_qwen3_8b_with_a_qwen3_0_6b_draft_serves_every_request_traced():
    sc = scenario("qwen3-8b", {"max_batch": 8, "prefill_chunk": 128},
                  draft={"model": "qwen3-0.6b", "device": "gpu"},
                  spec={"k": 4, "correction": "fused", "acceptance": {"alpha": 0.8}})
    served = serve(sc, "cuda")
    trace = served.trace
    assert all(r.finish is not None for r in trace.requests)
    kinds = {s.kind for s in trace.spans}
    assert {"prefill", "draft", "verify"} <= kinds
    m = compute_metrics(trace)
    assert m.completed == 8 and m.acceptance_source == "controlled"
    assert 2.0 < m.spec_decode_acceptance_length < 4.5  # alpha 0.8, k 4: about 3.4


@pytest.mark.parametrize("correction", ["fused", "separate"])
def test_the_organic_pair_accepts_for_real_and_serves_greedy_tokens(correction):
    sc = scenario("qwen3-0.6b", {"max_batch": 4, "prefill_chunk": 64},
                  draft={"model": "qwen3-0.6b", "quant": "int4-last-14", "device": "gpu"},
                  spec={"k": 4, "correction": correction,
                        "acceptance": {"alpha": 0.67, "on_hardware": "organic"}})
    served = serve(sc, "cuda", dtype=torch.float32)
    m = compute_metrics(served.trace)
    assert m.acceptance_source == "organic" and m.spec_decode_accepted_tokens > 0
    assert served.outputs == plain_greedy("qwen3-0.6b", served, torch.float32)


@pytest.mark.parametrize("serving", [
    {"max_batch": 4, "prefill_chunk": 64},
    {"max_batch": 4, "prefill_chunk": 64, "prefill_schedule": "alternate"},
    {"mode": "disaggregated", "devices": ["cuda:0"], "max_batch": 4, "prefill_chunk": 64},
])
def test_plain_serving_gives_greedy_tokens(serving):
    served = serve(scenario("qwen3-0.6b", serving), "cuda", dtype=torch.float32)
    assert all(r.finish is not None for r in served.trace.requests)
    assert served.outputs == plain_greedy("qwen3-0.6b", served, torch.float32)
    # the warm-up captured every graph the run replays: no worker stalled on a capture
    assert served.trace.meta["graph_captures_in_run"]["count"] == 0
    if serving.get("mode") == "disaggregated":
        assert sum(s.kind == "kv_transfer" for s in served.trace.spans) == 8


@pytest.mark.parametrize("on_kv_full", ["wait", "preempt"])
def test_a_decode_worker_runs_ahead_across_joins_and_leaves(on_kv_full):
    """kestrel_rt/serve/ahead.py on a GPU: the next round is launched before the host reads
    the one in flight, from its ids on the device (a graph's buffer) with the joiners' last
    tokens copied in beside them; the tokens stay greedy generation's."""
    changed = []

    def observer(eng, w, plan):
        if w.in_flight and {q.rid for q in plan.rows} != w.in_flight:
            changed.append(len(plan.rows))

    sc = scenario("qwen3-0.6b", {"mode": "disaggregated", "devices": ["cuda:0"],
                                 "max_batch": 3, "prefill_chunk": 64,
                                 "on_kv_full": on_kv_full}, requests=16, output=(2, 40))
    served = serve(sc, "cuda", dtype=torch.float32, observer=observer)
    assert all(r.finish is not None for r in served.trace.requests)
    assert served.outputs == plain_greedy("qwen3-0.6b", served, torch.float32)
    assert changed and served.trace.meta["decode_rounds_ahead"] > len(changed)


def test_a_finished_run_hands_its_gpu_memory_back():
    """`kestrel validate` serves scenario after scenario in one process: once a run is over,
    its models, caches and graphs are freed, and reclaim hands the cached blocks back (this
    process's reserved memory returns to where it was; device-wide free memory would count
    the other test workers')."""
    from kestrel_rt.memory import reclaim

    device = torch.device("cuda")
    reclaim(device)
    before = torch.cuda.memory_reserved(device)
    sc = scenario("qwen3-0.6b", {"mode": "disaggregated", "devices": ["cuda:0"],
                                 "max_batch": 4, "prefill_chunk": 64})
    served = serve(sc, "cuda")
    assert all(r.finish is not None for r in served.trace.requests)
    assert torch.cuda.memory_reserved(device) > before  # the run's blocks, still cached
    reclaim(device)
    assert torch.cuda.memory_reserved(device) - before < 64 << 20  # less than 64 MiB left
