"""Speculative decoding in the serving engine (CPU, tiny models): greedy speculation serves
plain greedy generation's tokens through every schedule (its draft on its own KV, prefilled
in chunks, handed over, recomputed after a preemption), a mixed step's prompt chunks ride
in the verify forward, and controlled acceptance draws from spec.acceptance."""

from __future__ import annotations

import pytest
from test_serve_engine import Limits, check_run
from tiny_models import build

from kestrel_rt.serve import serve
from kestrel_rt.serve.models import build_model
from kestrel_rt.serve.settings import UnsupportedScenarioError
from kestrel_sim.errors import ConfigError
from kestrel_sim.metrics import compute_metrics
from kestrel_sim.scenario import Scenario

MIXED = {"max_batch": 4, "max_batched_tokens": 40, "prefill_chunk": 16, "kv_capacity_tokens": 90}
SCHEDULES = {
    "mixed": MIXED,
    "alternate-wait": dict(MIXED, prefill_schedule="alternate", on_kv_full="wait"),
    "disaggregated": dict(MIXED, mode="disaggregated", max_batch=3),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target, and another random model of its shapes (a draft that rarely agrees)."""
    root = tmp_path_factory.mktemp("serve_spec")
    return {"same": build("tied", root / "tied"), "other": build("tied", root / "other", seed=1)}


@pytest.fixture(scope="module")
def reference(folders):
    return build_model(str(folders["same"]), "cpu")


def spec_scenario(folders, draft: str, serving: dict, correction="fused", k=3, requests=10,
                  acceptance=None, draft_device="cpu") -> Scenario:
    return Scenario.load_from_dict({
        "name": "tiny-spec", "hardware": "cpu-xeon", "model": str(folders["same"]),
        "draft": {"model": str(folders[draft]), "device": draft_device},
        "spec": {"k": k, "correction": correction, "acceptance": acceptance or {"alpha": 0.7}},
        "serving": serving,
        "workload": {  # every request sent at time 0: the steps do not depend on the machine
            "arrivals": {"process": "closed", "concurrency": requests}, "requests": requests,
            "prompt_tokens": {"dist": "uniform", "low": 4, "high": 40},
            "output_tokens": {"dist": "uniform", "low": 1, "high": 16}, "seed": 0},
    })


@pytest.mark.parametrize(("draft", "correction", "schedule", "threads"), [
    ("same", "fused", "mixed", False),
    ("other", "separate", "mixed", False),
    ("same", "separate", "disaggregated", False),
    ("other", "fused", "alternate-wait", False),
    ("same", "fused", "disaggregated", True),
])
def test_greedy_speculation_serves_greedy_tokens(folders, reference, draft, correction,
                                                 schedule, threads):
    sc = spec_scenario(folders, draft, SCHEDULES[schedule], correction)
    served = serve(sc, "cpu", observer=Limits(), threads=threads)
    check_run(served, reference, sc)
    meta = served.trace.meta
    assert meta["acceptance_controlled"] is False and meta["k"] == 3
    stats = meta["spec_decode"]
    assert stats["spec_decode_num_drafts"] > 0
    if draft == "same":  # the target's own weights: every proposal it can make is kept
        assert stats["spec_decode_accepted_tokens"] == stats["spec_decode_draft_tokens"]
    kinds = {s.kind for s in served.trace.spans}
    assert {"draft", "verify", "prefill"} <= kinds
    assert ("correction" in kinds) == (correction == "separate")
    if not threads and schedule != "alternate-wait":
        assert meta["preemptions"] > 0  # and the recompute refilled the draft's KV too


def test_mixed_step_puts_the_chunks_in_the_verify_forward(folders, reference):
    sc = spec_scenario(folders, "same", SCHEDULES["mixed"], draft_device="gpu")
    served = serve(sc, "cpu")
    check_run(served, reference, sc)
    spans = served.trace.spans
    verify = {(s.start, s.end) for s in spans if s.kind == "verify"}
    target_prefill = [s for s in spans if s.kind == "prefill" and s.worker == "gpu0/target"]
    assert any((s.start, s.end) in verify for s in target_prefill)  # one forward, two spans
    assert {s.worker for s in spans if s.kind == "draft"} == {"gpu0/draft"}
    draft_prefill = [s for s in spans if s.kind == "prefill" and s.worker == "gpu0/draft"]
    # the draft prefilled every prompt token the target did
    assert sum(s.tokens for s in draft_prefill) == sum(s.tokens for s in target_prefill)
    assert served.trace.meta["workers"]["gpu0/draft"] == "draft"


def test_controlled_acceptance_draws_from_the_scenario(folders):
    sc = spec_scenario(folders, "other", SCHEDULES["mixed"], k=4, requests=8,
                       acceptance={"per_position": [0.9, 0.8, 0.7, 0.6]})
    served = serve(sc, "cpu", controlled=True)
    meta = served.trace.meta
    assert meta["acceptance_controlled"] and meta["spec_decode"]["spec_decode_controlled"]
    assert meta["spec_decode"]["spec_decode_acceptance_length"] > 2  # organically ~1
    for rec, out in zip(served.trace.requests, served.outputs):
        assert rec.finish is not None and len(out) == rec.output_tokens
    metrics = compute_metrics(served.trace, sc.slo)
    assert 50 < metrics.spec_decode_acceptance_rate <= 100
    assert len(metrics.spec_decode_per_position_acceptance_rates) == 4
    assert metrics.spec_decode_accepted_tokens == meta["spec_decode"]["spec_decode_accepted_tokens"]
    verify = [s for s in served.trace.spans if s.kind == "verify"]
    assert all(s.proposed == 4 and all(0 <= a <= 4 for a in s.accepted) for s in verify)


def test_refuses_an_acceptance_trace(folders, tmp_path):
    lengths = tmp_path / "accepted.txt"
    lengths.write_text("0\n2\n3\n")
    sc = spec_scenario(folders, "same", MIXED, acceptance={"trace": str(lengths)})
    with pytest.raises(UnsupportedScenarioError, match=r"spec\.acceptance\.trace"):
        serve(sc, "cpu")


def test_refuses_a_k_the_decoder_does_not_take(folders):
    sc = spec_scenario(folders, "same", dict(MIXED, max_batched_tokens=200), k=40)
    with pytest.raises(ConfigError, match="spec"):
        serve(sc, "cpu")
