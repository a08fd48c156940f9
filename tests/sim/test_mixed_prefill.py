"""Colocated `prefill_schedule: mixed` (vLLM's chunked prefill): prefill chunks ride in the
decode/verify forward. Token conservation, the token budget, the cost of a mixed step
under each cost model, its trace convention (busy time counted once), and why vLLM does
it: fewer decode stalls than alternating prefill steps with rounds."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.base import Chunk
from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.table import TableCost
from kestrel_sim.errors import ConfigError
from kestrel_sim.hardware import load_hardware
from kestrel_sim.metrics import compute_metrics, stage_seconds, worker_busy
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario, TableCosts, json_schema
from kestrel_sim.trace import Trace
from kestrel_sim.workload import draw_workload
from kestrel_sim.yamlio import load_model

H200 = load_hardware("h200")


def scenario(spec: str | None = "fused", **serving) -> Scenario:
    data = {
        "name": "mixed",
        "serving": {"max_batch": 32, "max_batched_tokens": 2048, "prefill_chunk": 512,
                    **serving},
        "workload": {
            "arrivals": {"process": "poisson", "rate": 6.0},
            "requests": 200,
            "prompt_tokens": {"dist": "uniform", "low": 16, "high": 3000},
            "output_tokens": {"dist": "uniform", "low": 1, "high": 200},
            "seed": 5,
        },
    }
    if spec is not None:
        data["draft"] = {"model": "qwen3-0.6b"}
        data["spec"] = {"k": 3, "correction": spec, "acceptance": {"alpha": 0.7}}
    return Scenario.load_from_dict(data)


def mixed_forwards(trace) -> list[tuple]:
    """(decode-or-verify span, prefill span) pairs sharing worker, start and end."""
    steps = {(s.worker, s.start, s.end): s for s in trace.spans if s.kind in ("decode", "verify")}
    return [(steps[(s.worker, s.start, s.end)], s) for s in trace.spans
            if s.kind == "prefill" and (s.worker, s.start, s.end) in steps]


@pytest.mark.parametrize("policy", ["preempt", "wait"])
@pytest.mark.parametrize("spec", ["fused", "separate", None])
def test_mixed_conserves_tokens_and_finishes_every_request(spec, policy):
    sc = scenario(spec, on_kv_full=policy,
                  kv_capacity_tokens=5000 if policy == "preempt" else None)
    tr = simulate(sc)  # also asserts that every worker released all of its KV
    drawn = draw_workload(sc.workload, np.random.default_rng(sc.workload.seed))
    for r in tr.requests:
        assert r.finish is not None and r.emit_times[-1] == r.finish
        assert sum(r.emit_counts) == drawn.output[r.id]  # every drawn token, no more
        assert r.arrival <= r.prefill_start <= r.emit_times[0]
    pairs = mixed_forwards(tr)
    assert pairs, "no prefill chunk rode in a decode/verify forward"
    k = sc.spec.k if sc.spec else 0
    for step, chunk in pairs:
        assert step.tokens == len(step.requests) * (k + 1)
        assert step.tokens + chunk.tokens <= sc.serving.max_batched_tokens
        assert chunk.tokens <= sc.serving.prefill_chunk * len(chunk.requests)
        assert not set(step.requests) & set(chunk.requests)
    # every prompt token is prefilled on the target exactly once (preempted ones again)
    prefilled = sum(s.tokens for s in tr.spans
                    if s.kind == "prefill" and s.worker.endswith("/target"))
    if policy == "wait":
        assert tr.meta["preemptions"] == 0
        assert prefilled == int(drawn.prompt.sum())
    else:
        assert tr.meta["preemptions"] > 0
        assert prefilled > int(drawn.prompt.sum())
    if spec == "separate":  # the correction stays its own one-token forward
        ends = {(s.worker, s.end) for s, _ in pairs}
        corr = [s for s in tr.spans if s.kind == "correction" and (s.worker, s.start) in ends]
        assert len(corr) == len(pairs) and all(c.tokens == len(c.requests) for c in corr)


def test_alternate_never_mixes_and_mixed_is_the_colocated_default():
    assert scenario().serving.prefill_schedule == "mixed"
    alt = simulate(scenario(prefill_schedule="alternate"))
    assert not mixed_forwards(alt)
    mixed = simulate(scenario())
    assert mixed.meta["prefill_schedule"] == "mixed"
    assert alt.meta["prefill_schedule"] == "alternate"


@pytest.mark.parametrize("spec", [None, "fused"])
def test_schedules_coincide_at_batch_one(spec):
    """max_batch 1: no prompt is admitted while a request decodes, so nothing waits to
    ride in a round and both schedules give the same trace, span for span."""
    traces = [simulate(scenario(spec, max_batch=1, prefill_schedule=s))
              for s in ("mixed", "alternate")]
    a, b = ([(s.kind, s.worker, s.start, s.end, s.requests, s.accepted) for s in t.spans]
            for t in traces)
    assert a == b and len(a) > 100
    assert [r.emit_times for r in traces[0].requests] == [r.emit_times for r in
                                                         traces[1].requests]


@pytest.mark.parametrize("spec", [None, "fused"])
def test_mixed_lowers_decode_stalls_under_long_prompts(spec):
    """Long prompts under load: alternating makes every decode gap a round plus a prefill
    step; mixing reads the weights once for both, so the p99 gaps shrink (why vLLM and
    Sarathi-Serve mix), and the prompts drain faster too."""
    def run(schedule: str):
        sc = scenario(spec, max_batch=64, prefill_schedule=schedule)
        sc.workload.arrivals.rate = 4.0
        sc.workload.requests = 300
        sc.workload.prompt_tokens.low, sc.workload.prompt_tokens.high = 2000, 8000
        sc.workload.output_tokens.low, sc.workload.output_tokens.high = 64, 256
        return compute_metrics(simulate(sc))

    alt, mixed = run("alternate"), run("mixed")
    assert mixed.p99_itl_ms < 0.9 * alt.p99_itl_ms
    assert mixed.p99_tpot_ms < 0.9 * alt.p99_tpot_ms
    assert mixed.mean_ttft_ms < alt.mean_ttft_ms
    assert mixed.output_throughput >= 0.99 * alt.output_throughput


CASES = [("decode", 1, 1, 1000, Chunk(1, 512, 0)), ("decode", 64, 1, 2000, Chunk(2, 1000, 500)),
         ("verify", 32, 5, 1500, Chunk(1, 2048, 4096)), ("verify", 8, 5, 300, Chunk(3, 40, 0))]


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("stage,b,m,c,chunk", CASES)
def test_roofline_mixed_step_reads_the_weights_once(model, stage, b, m, c, chunk):
    cost = RooflineCost(H200, preset(model))
    step = cost.seconds(stage, b, m, c)
    alone = cost.seconds("prefill", chunk.batch, chunk.m, chunk.context)
    mixed = cost.mixed_seconds(stage, b, m, c, chunk)
    assert max(step, alone) <= mixed < step + alone
    assert step + alone - mixed >= cost._fixed * (1 - 1e-9)  # launches and overhead once


def test_roofline_decode_rides_a_compute_bound_chunk_nearly_free():
    """A one-sequence decode step is a weight read; a 512-token chunk already reads the
    weights (and is compute-bound), so adding the decode token costs little."""
    cost = RooflineCost(H200, preset("qwen3-8b"))
    step = cost.seconds("decode", 1, 1, 1000)
    alone = cost.seconds("prefill", 1, 512, 0)
    weights = cost.weight_bytes / (H200.mem_bandwidth_tb_s * 1e12)
    assert step > 0.8 * weights  # the decode step is (almost) all weight read
    assert cost.mixed_seconds("decode", 1, 1, 1000, Chunk(1, 512, 0)) - alone < 0.05 * step


def test_table_mixed_rule():
    t = TableCost(TableCosts(prefill=2.0, prefill_per_token=0.01, verify=3.0, decode=1.0))
    # verify + per-token x P (the per-step prefill cost is paid once, by the forward)
    assert t.mixed_seconds("verify", 4, 5, 0, Chunk(2, 100, 0)) == pytest.approx(5e-3)
    # never below the chunk as its own step: max(1 + 0.1, 2 + 0.1) ms
    assert t.mixed_seconds("decode", 4, 1, 0, Chunk(1, 10, 0)) == pytest.approx(2.1e-3)
    no_slope = TableCost(TableCosts(prefill=2.0, decode=1.0))  # nothing to split: no saving
    assert no_slope.mixed_seconds("decode", 4, 1, 0, Chunk(1, 10, 0)) == pytest.approx(3e-3)


def roofline_profile() -> Profile:
    """A profile measured by the roofline itself (no mixed steps in it, as a real one)."""
    roof = RooflineCost(H200, preset("qwen3-8b"))
    grid = {"prefill": ([1, 2], [128, 512, 2048, 8192], [0, 4096]),
            "decode": ([1, 2, 4, 8, 16, 32, 64], [1], [256, 4096]),
            "verify": ([1, 2, 4, 8, 16, 32, 64], [5], [256, 4096])}
    rows = [{"stage": st, "batch": b, "tokens_per_seq": m, "context": c,
             "ms": roof.seconds(st, b, m, c) * 1e3}
            for st, (bs, ms, cs) in grid.items() for b in bs for m in ms for c in cs]
    return Profile.model_validate({"fingerprint": {"device": "NVIDIA H200", "model": "qwen3-8b"},
                                   "measurements": rows})


@pytest.mark.parametrize("stage,b,m,c,chunk", CASES)
def test_profile_mixed_step_is_bounded_and_conservative(stage, b, m, c, chunk):
    fit, roof = ProfileCost(roofline_profile()), RooflineCost(H200, preset("qwen3-8b"))
    step = fit.seconds(stage, b, m, c)
    alone = fit.seconds("prefill", chunk.batch, chunk.m, chunk.context)
    mixed = fit.mixed_seconds(stage, b, m, c, chunk)
    assert max(step, alone) <= mixed <= step + alone
    # not below the truth the profile was measured from (5%: the fit's own error)
    assert mixed >= 0.95 * roof.mixed_seconds(stage, b, m, c, chunk)


def test_profile_without_prefill_rows_names_the_stage():
    rows = [r for r in roofline_profile().measurements if r.stage != "prefill"]
    fit = ProfileCost(Profile(fingerprint=roofline_profile().fingerprint, measurements=rows))
    with pytest.raises(ConfigError, match="prefill"):
        fit.mixed_seconds("decode", 4, 1, 100, Chunk(1, 100, 0))


def test_mixed_step_busy_time_is_counted_once():
    tr = simulate(scenario("separate"))
    busy = worker_busy(tr)
    per_worker: dict[str, float] = {}
    for (worker, _), sec in stage_seconds(tr).items():
        per_worker[worker] = per_worker.get(worker, 0.0) + sec
    assert per_worker == pytest.approx(busy, rel=1e-9)
    m = compute_metrics(tr)
    assert sum(m.stage_share.values()) == pytest.approx(1.0)
    assert all(0 < u <= 1 for u in m.worker_utilization.values())
    # a mixed forward's seconds are split by tokens between its two spans
    step, chunk = mixed_forwards(tr)[0]
    split = stage_seconds(Trace(spans=[step, chunk]))
    total = step.end - step.start
    assert split[(step.worker, "prefill")] == pytest.approx(
        total * chunk.tokens / (chunk.tokens + step.tokens))
    assert sum(split.values()) == pytest.approx(total)


def test_schedule_is_in_the_schema_and_only_for_colocated(tmp_path):
    field = json_schema()["$defs"]["Serving"]["properties"]["prefill_schedule"]
    assert field["default"] == "mixed" and "vLLM" in field["description"]
    path = tmp_path / "x.yaml"
    path.write_text("workload: {arrivals: {process: poisson, rate: 1}}\n"
                    "serving:\n  mode: disaggregated\n  prefill_schedule: alternate\n")
    with pytest.raises(ConfigError, match=r"x.yaml:2.*prefill_schedule only applies"):
        load_model(path, Scenario)
