"""Disaggregated serving over two GPUs (skipped on a machine with fewer): the workers placed
on cuda:0 and cuda:1, the KV handed over by peer copies, the output plain greedy
generation's, the bookkeeping clean, the spans of both devices on one clock; and the
calibration's kv_transfer between the two GPUs."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)

from test_serve_engine import all_at_once, same_as_greedy, scenario
from test_serve_placement import Arrived, check_handover

from calibration.grid import Point
from calibration.measure import Bench, measure, transfer_caches
from kestrel_rt.serve import serve
from kestrel_rt.serve.models import build_model


@pytest.fixture(scope="module")
def reference(folder):
    return build_model(str(folder), "cuda:0")


def serving(p: int, d: int, **more) -> dict:
    return {"mode": "disaggregated", "prefill_workers": p, "decode_workers": d,
            "max_batch": 4, "max_batched_tokens": 64, "prefill_chunk": 32,
            "kv_capacity_tokens": 200, "on_kv_full": "wait", **more}


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 2), (1, 3)])
def test_disaggregated_over_two_gpus(folder, reference, p, d):
    sc = scenario(folder, serving(p, d), requests=16, arrivals=all_at_once(16))
    watch = Arrived()
    served = serve(sc, "cuda", observer=watch)
    same_as_greedy(served, reference)
    check_handover(served, watch.eng, sc)
    meta = served.trace.meta
    names = [f"prefill{i}" for i in range(p)] + [f"decode{i}" for i in range(d)]
    assert meta["placement"] == {n: f"cuda:{i % 2}" for i, n in enumerate(names)}
    assert meta["threads"] is True
    spans = served.trace.spans
    assert all(0 <= s.start <= s.end <= meta["end_time"] + 1e-3 for s in spans)
    moved = {}
    for s in spans:
        if s.kind == "kv_transfer":
            moved[s.requests[0]] = max(moved.get(s.requests[0], 0.0), s.end)
    for rec in served.trace.requests:  # the first token reaches the client with its KV
        if rec.id in moved:
            assert rec.emit_times[0] >= moved[rec.id] - 1e-4
    if (p, d) == (1, 1):  # every copy crosses from cuda:0 to cuda:1
        assert len(moved) == sum(r.output_tokens > 1 for r in served.trace.requests)


def test_the_draft_kv_crosses_with_the_target_kv(folder, reference):
    sc = scenario(folder, serving(1, 1), requests=8, output=(4, 16), arrivals=all_at_once(8),
                  k=2)
    sc = sc.model_copy(update={"draft": sc.draft.model_copy(update={"device": "gpu"})})
    watch = Arrived()
    served = serve(sc, "cuda", observer=watch)
    same_as_greedy(served, reference)
    check_handover(served, watch.eng, sc)
    assert served.trace.meta["spec_decode"]["spec_decode_acceptance_rate"] == 100.0


def test_explicit_placement_on_one_gpu_copies_within_it(folder, reference):
    sc = scenario(folder, serving(1, 1, devices=["cuda:1"]), requests=8,
                  arrivals=all_at_once(8))
    served = serve(sc, "cuda")
    same_as_greedy(served, reference)
    assert set(served.trace.meta["placement"].values()) == {"cuda:1"}


def test_calibration_times_the_copy_between_the_gpus(folder):
    model = build_model(str(folder), "cuda:0")
    model.allocate_kv(2, 64)
    bench = Bench("target@gpu", model, [0, 1], warmup=1, repeats=3)
    bench.transfers["cuda:1"] = src, dst = transfer_caches(model, 64, "cuda:1")
    src.k.normal_()
    src.v.normal_()
    record = measure(bench, Point("target", "gpu", "kv_transfer", 1, 48, peer="cuda:1"))
    assert record.link == "cuda:0->cuda:1" and record.ms > 0
    torch.cuda.synchronize()
    assert dst.k.device == torch.device("cuda:1")
    assert torch.equal(dst.k[:, 0, :48].cpu(), src.k[:, 0, :48].cpu())
    assert torch.equal(dst.v[:, 0, :48].cpu(), src.v[:, 0, :48].cpu())
    assert not dst.k[:, 0, 48:].any()
