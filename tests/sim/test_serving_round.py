"""How the simulator prices a speculative round as the runtime serves it (kestrel_rt/serve,
kestrel_rt/spec): steps at the runtime's CUDA-graph batch bucket (Profile.runtime), a lagging
draft's first step at two tokens per sequence, the draft's own prompt pass from its
draft_prefill rows, and the loop's host time per round fitted to whole-round rows."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.profile import ProfileCost, ProfileFits
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.costs.shape import model_shape
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile
from kestrel_sim.runtime_info import RuntimeInfo
from kestrel_sim.scenario import Scenario

H200 = load_hardware("h200")
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
OVERHEAD = (0.4, 0.05)  # ms per round, ms per sequence: what the round rows add
DECODE_OVERHEAD = (0.3, 0.01)  # ... and the plain decode rounds' (k = 0)


def rows_of(cost, stage, batches, ms_, contexts, name=None):
    return [{"stage": name or stage, "batch": b, "tokens_per_seq": m, "context": c,
             "ms": cost.seconds(stage, b, m, c) * 1e3}
            for b in batches for m in ms_ for c in contexts]


def profile(runtime: bool = True, rounds: bool = True, draft_prefill: bool = True,
            catch_up_ms: float = 0.0) -> Profile:
    """A profile the roofline measured: qwen3-8b target, qwen3-0.6b draft on the GPU. The
    draft's two-token steps cost `catch_up_ms` more than the roofline says; the round rows
    are their stages plus OVERHEAD."""
    target, draft = RooflineCost(H200, preset("qwen3-8b")), RooflineCost(H200, preset("qwen3-0.6b"))
    rows = (rows_of(target, "decode", BUCKETS, [1], [256, 4096])
            + rows_of(target, "verify", BUCKETS, [2, 5, 9], [256, 4096])
            + rows_of(target, "prefill", [1], [512, 2048], [0])
            + rows_of(draft, "draft", BUCKETS, [1], [256, 4096]))
    for r in rows_of(draft, "draft", BUCKETS, [2], [256, 4096]):
        rows.append({**r, "ms": r["ms"] + catch_up_ms})
    if draft_prefill:
        rows += [{**r, "ms": 3 * r["ms"]}  # a host-bound prompt pass: 3x the roofline
                 for r in rows_of(draft, "prefill", [1], [512, 2048], [0], "draft_prefill")]
    if rounds:
        for b in (1, 2, 4, 8, 16):
            rows.append({"stage": "round", "batch": b, "tokens_per_seq": 1, "context": 512,
                         "ms": target.seconds("decode", b, 1, 511) * 1e3
                         + DECODE_OVERHEAD[0] + DECODE_OVERHEAD[1] * b})
            for k in (2, 4):
                stages = k * draft.seconds("draft", b, 1, 512) + target.seconds("verify", b, k + 1, 512)
                rows.append({"stage": "round", "batch": b, "tokens_per_seq": k + 1,
                             "context": 512, "ms": stages * 1e3 + OVERHEAD[0] + OVERHEAD[1] * b})
    return Profile.model_validate({
        "fingerprint": {"device": "NVIDIA H200", "model": "qwen3-8b", "draft_model": "qwen3-0.6b"},
        "runtime": {"batch_buckets": BUCKETS} if runtime else None,
        "measurements": rows})


def fits_of(p: Profile) -> ProfileFits:
    return ProfileFits(p, model_shape("qwen3-8b"), model_shape("qwen3-0.6b"))


def test_runtime_buckets_validate_and_name_the_graph_a_step_replays():
    info = RuntimeInfo(batch_buckets=BUCKETS, max_m=16)
    assert [info.bucket(b, 5) for b in (1, 3, 5, 8, 9, 33, 64)] == [1, 4, 8, 8, 16, 64, 64]
    assert info.bucket(65, 1) == 65 and info.bucket(5, 17) == 5  # eager: as it is
    for bad in ([4, 2], [0, 1], [1, 1]):
        with pytest.raises(ValueError, match="ascending"):
            RuntimeInfo(batch_buckets=bad)


def test_steps_are_priced_at_their_bucket_where_the_runtime_pads():
    padded, plain = ProfileCost(profile()), ProfileCost(profile(runtime=False))
    for stage, m in (("verify", 5), ("decode", 1)):
        assert padded.seconds(stage, 5, m, 1000) == pytest.approx(plain.seconds(stage, 8, m, 1000))
        assert padded.seconds(stage, 8, m, 1000) == pytest.approx(plain.seconds(stage, 8, m, 1000))
        assert plain.seconds(stage, 5, m, 1000) < plain.seconds(stage, 8, m, 1000)
    # a prompt pass is no batch-bucketed graph, and the shares follow the padded step
    assert padded.seconds("prefill", 1, 512, 0) == plain.seconds("prefill", 1, 512, 0)
    assert padded.shares("verify", 5, 5, 1000) == plain.shares("verify", 8, 5, 1000)


def test_a_draft_prices_its_prompt_pass_from_its_own_rows():
    fits = fits_of(profile())
    draft = ProfileCost(fits.profile, fits=fits, stages=("draft", "draft_prefill"))
    measured = RooflineCost(H200, preset("qwen3-0.6b")).seconds("prefill", 1, 512, 0) * 3
    assert draft.seconds("prefill", 1, 512, 0) == pytest.approx(measured, rel=0.02)
    target = ProfileCost(fits.profile, fits=fits)  # the target's prefill stays its own
    own = RooflineCost(H200, preset("qwen3-8b")).seconds("prefill", 1, 512, 0)
    assert target.seconds("prefill", 1, 512, 0) == pytest.approx(own, rel=0.02)


def test_round_overhead_is_fitted_from_whole_rounds():
    got = fits_of(profile()).round_overhead()
    assert got is not None and got.rows == 10
    assert got.fixed_ms == pytest.approx(OVERHEAD[0], abs=0.02)
    assert got.per_seq_ms == pytest.approx(OVERHEAD[1], abs=0.005)
    assert fits_of(profile(rounds=False)).round_overhead() is None


def scenario(alpha: float = 0.7, **extra) -> Scenario:
    return Scenario.load_from_dict({
        "name": "round", "model": "qwen3-8b", "draft": {"model": "qwen3-0.6b"},
        "spec": {"k": 4, "correction": "fused", "acceptance": {"alpha": alpha}},
        "serving": {"max_batch": 16},
        "workload": {"arrivals": {"process": "poisson", "rate": 4.0}, "requests": 30,
                     "prompt_tokens": {"dist": "fixed", "value": 256},
                     "output_tokens": {"dist": "fixed", "value": 64}, "seed": 3},
        **extra})


def run_on(tmp_path, p: Profile, alpha: float = 0.7):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(p.model_dump(mode="json", exclude_none=True)))
    return simulate(scenario(alpha, costs={"profile": str(path)}), trace="full")


def rounds_of(trace):
    """Per verify span: the draft spans of its round, in order."""
    spans = sorted(trace.spans, key=lambda s: s.start)
    out, steps = [], []
    for s in spans:
        if s.kind == "draft":
            steps.append(s)
        elif s.kind == "verify":
            out.append((steps, s))
            steps = []
    return out


def test_a_lagging_draft_feeds_two_tokens_in_its_first_step(tmp_path):
    slow = 0.5  # ms a two-token draft step costs beyond a one-token one
    run = run_on(tmp_path, profile(rounds=False, catch_up_ms=slow), alpha=1.0)
    rounds = rounds_of(run)
    lagged = [(steps, v) for steps, v in rounds if len(steps) == 4
              and steps[0].end - steps[0].start > steps[1].end - steps[1].start + 0.4e-3]
    # alpha 1: every round accepts all k, so every round after a sequence's first lags
    assert len(lagged) > 0.8 * len(rounds)
    never = run_on(tmp_path, profile(rounds=False, catch_up_ms=slow), alpha=0.0)
    for steps, _ in rounds_of(never):
        durations = [s.end - s.start for s in steps]
        assert max(durations) - min(durations) < 0.4e-3  # no catch-up step: nothing lags


def test_the_round_overhead_is_an_untraced_gap_after_each_round(tmp_path):
    with_rounds = run_on(tmp_path, profile())
    without = run_on(tmp_path, profile(rounds=False))
    gap = [steps[0].start - prev_v.end for (_, prev_v), (steps, _) in
           zip(rounds_of(with_rounds), rounds_of(with_rounds)[1:])
           if steps and steps[0].requests == prev_v.requests]
    assert gap and min(gap) >= OVERHEAD[0] * 1e-3 * 0.9
    assert with_rounds.metrics.median_tpot_ms > without.metrics.median_tpot_ms


def test_the_fit_report_gives_the_round_overhead_and_its_held_out_error(tmp_path):
    from kestrel_sim.costs.report import fit_report

    report = fit_report(profile(), "p.json", fits=fits_of(profile()))
    r = report.rounds["speculative"]
    assert r["rows"] == 10 and r["fixed_ms"] == pytest.approx(OVERHEAD[0], abs=0.02)
    assert r["median_pct"] < 1.0  # the rows are their stages + an exact line
    assert "speculative round overhead: 0.4" in report.table()
    d = report.rounds["decode"]  # the plain decode rounds: their own overhead
    assert d["rows"] == 5 and d["fixed_ms"] == pytest.approx(DECODE_OVERHEAD[0], abs=0.02)
    assert d["per_seq_ms"] == pytest.approx(DECODE_OVERHEAD[1], abs=0.003)
    assert fit_report(profile(rounds=False), "p.json").rounds is None


def test_the_stage_audit_of_a_simulated_run_prices_every_span_as_it_ran(tmp_path):
    """The simulator's own trace, priced by its own costs at each span's shape: the audit
    reads the shapes back (batch, tokens per sequence, context, mixed chunks) exactly."""
    import numpy as np

    from kestrel_sim.costs.build import build_costs
    from kestrel_sim.stage_audit import stage_audit, totals

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile(catch_up_ms=0.5).model_dump(mode="json",
                                                                   exclude_none=True)))
    sc = scenario(0.9, costs={"profile": str(path)})
    run = simulate(sc, trace="full")
    rows = stage_audit(run, build_costs(sc, np.random.default_rng(0)))
    stages = {(r["worker"], r["stage"]) for r in rows}
    assert {("target", "verify"), ("target", "verify + prompt chunk"), ("draft", "draft"),
            ("draft", "prefill")} <= stages
    assert any(r.get("tokens_per_seq") == 2 for r in rows)  # catch-up steps seen as such
    for r in rows:  # (a round's draft steps are priced at its first step's context)
        assert r["error_pct"] == pytest.approx(0.0, abs=0.1), r
    assert sum(t["spans"] for t in totals(rows)) == sum(r["spans"] for r in rows)


def test_a_kept_audit_is_priced_again_at_its_groups_mean_shapes(tmp_path):
    import numpy as np

    from kestrel_sim.costs.build import build_costs
    from kestrel_sim.stage_audit import reprice, stage_audit

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().model_dump(mode="json", exclude_none=True)))
    sc = scenario(0.9, costs={"profile": str(path)})
    costs = build_costs(sc, np.random.default_rng(0))
    rows = stage_audit(simulate(sc, trace="full"), costs)
    again = reprice(rows, costs)
    assert len(again) == len(rows)
    for r, a in zip(rows, again):  # the mean shape's price: the mean price, nearly
        assert a["priced_ms"] == pytest.approx(r["priced_ms"], rel=0.01)
        assert a["measured_ms"] == r["measured_ms"]
    slow = tmp_path / "slow.json"  # two-token draft steps 0.5 ms dearer
    slow.write_text(json.dumps(profile(catch_up_ms=0.5).model_dump(mode="json",
                                                                   exclude_none=True)))
    dear = reprice(rows, build_costs(scenario(0.9, costs={"profile": str(slow)}),
                                     np.random.default_rng(0)))
    for r, a in zip(rows, dear):
        if r["stage"] == "draft" and r["tokens_per_seq"] == 2:
            assert a["priced_ms"] == pytest.approx(r["priced_ms"] + 0.5, rel=0.02)
        else:
            assert a["priced_ms"] == pytest.approx(r["priced_ms"], rel=0.01)


def test_the_suite_summary_names_the_stages_furthest_off(tmp_path):
    from kestrel_cli.suite_summary import entry_of, markdown, summarize

    folder = tmp_path / "s"
    folder.mkdir()
    audit = [{"worker": "draft", "stage": "prefill", "batch": 1, "tokens_per_seq": 512,
              "context": 0, "spans": 100, "measured_ms": 5.0, "priced_ms": 1.4,
              "error_pct": -72.0},
             {"worker": "target", "stage": "verify", "batch": 4, "tokens_per_seq": 5,
              "context": 600, "spans": 1000, "measured_ms": 10.0, "priced_ms": 9.5,
              "error_pct": -5.0}]
    (folder / "comparison.json").write_text(json.dumps({
        "rows": [{"metric": "median_tpot_ms", "measured": 8.0, "predicted": 6.0,
                  "error_pct": -25.0}], "failed": ["median_tpot_ms"], "stage_audit": audit}))
    e = entry_of(scenario(), folder)
    assert e.gaps[0].startswith("verify on the target: -5.0% (10 s measured)")
    assert e.gaps[1].startswith("prefill on the draft: -72.0%")
    text = markdown(summarize([e]), "t")
    assert "- round: verify on the target: -5.0%" in text


def test_prompt_chunks_are_priced_at_their_prefill_graphs_length():
    info = RuntimeInfo(batch_buckets=BUCKETS, prefill_buckets=[32, 64, 128, 384, 512])
    assert [info.prefill_tokens(m) for m in (5, 16, 17, 100, 300, 512, 600)] == [
        5, 16, 32, 128, 384, 512, 600]  # a step graph's own length, a bucket, eager
    with pytest.raises(ValueError, match="prefill_buckets"):
        RuntimeInfo(batch_buckets=BUCKETS, prefill_buckets=[64, 32])
    p = profile()
    graphs = p.model_copy(update={"runtime": info})
    padded, plain = ProfileCost(graphs), ProfileCost(p)
    assert padded.seconds("prefill", 1, 300, 0) == pytest.approx(plain.seconds("prefill", 1, 384, 0))
    assert padded.seconds("prefill", 1, 600, 0) == pytest.approx(plain.seconds("prefill", 1, 600, 0))
    from kestrel_sim.costs.base import Chunk

    assert padded.mixed_seconds("verify", 5, 5, 500, Chunk(1, 300, 0)) == pytest.approx(
        plain.mixed_seconds("verify", 8, 5, 500, Chunk(1, 384, 0)))


def test_a_plain_decode_round_pays_the_host_only_where_it_cannot_run_ahead(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().model_dump(mode="json", exclude_none=True)))

    def decode_gaps(requests: int, rate: float) -> list[float]:
        sc = Scenario.load_from_dict({
            "name": "plain", "model": "qwen3-8b", "serving": {"max_batch": 16},
            "costs": {"profile": str(path)},
            "workload": {"arrivals": {"process": "poisson", "rate": rate}, "requests": requests,
                         "prompt_tokens": {"dist": "fixed", "value": 64},
                         "output_tokens": {"dist": "fixed", "value": 30}, "seed": 1}})
        spans = sorted((s for s in simulate(sc, trace="full").spans if s.kind == "decode"),
                       key=lambda s: s.start)
        return [(b.start - a.end) * 1e3 for a, b in pairwise(spans)]

    host = DECODE_OVERHEAD[0] + DECODE_OVERHEAD[1]  # ms, one sequence
    gaps = decode_gaps(1, 1.0)  # one request alone: 29 rounds of the same row
    assert gaps[0] == pytest.approx(host, rel=1e-3)  # after the prefill step: not ahead
    assert all(g == pytest.approx(0.0, abs=1e-9) for g in gaps[1:])  # then run ahead
    busy = decode_gaps(40, 200.0)  # arrivals queued behind: rounds change, none ahead
    assert sum(g > 0.9 * DECODE_OVERHEAD[0] for g in busy) > len(busy) / 2


def test_a_decode_worker_runs_ahead_across_joins_and_leaves(tmp_path):
    """A disaggregated decode worker launches its next round before the host reads the last,
    whatever joins or leaves (kestrel_rt/serve/ahead.py next_rows): only a round after it
    was idle pays the host."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().model_dump(mode="json", exclude_none=True)))
    sc = Scenario.load_from_dict({
        "name": "plain", "model": "qwen3-8b",
        "serving": {"mode": "disaggregated", "prefill_workers": 1, "decode_workers": 1,
                    "max_batch": 16, "link": "nvlink"},
        "costs": {"profile": str(path)},
        "workload": {"arrivals": {"process": "poisson", "rate": 200.0}, "requests": 40,
                     "prompt_tokens": {"dist": "fixed", "value": 64},
                     "output_tokens": {"dist": "uniform", "low": 10, "high": 40}, "seed": 1}})
    run = simulate(sc, trace="full")
    spans = sorted((s for s in run.spans if s.kind == "decode"), key=lambda s: s.start)
    sizes = [len(s.requests) for s in spans]
    assert len(set(sizes)) > 3  # rows joined and left all along
    gaps = [(b.start - a.end) * 1e3 for a, b in pairwise(spans)]
    paid = [g for g in gaps if g > 0.9 * DECODE_OVERHEAD[0]]
    assert len(paid) <= 2  # after idle only, where the loop starts from the host
