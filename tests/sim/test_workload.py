"""Arrival processes, length distributions and acceptance models, drawn from a seeded Generator."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from kestrel_sim import simulate
from kestrel_sim.acceptance import build_acceptance, leviathan_tokens, pmf_from_rates
from kestrel_sim.scenario import Acceptance, Scenario, Workload
from kestrel_sim.workload import draw_workload


def workload(tmp_path=None, **data) -> Workload:
    ctx = {"base_dir": tmp_path} if tmp_path else None
    return Workload.model_validate(data, context=ctx)


def draw(w: Workload, seed: int = 0):
    return draw_workload(w, np.random.default_rng(seed))


def test_poisson_rate_and_exponential_gaps():
    d = draw(workload(arrivals={"process": "poisson", "rate": 5.0}, requests=50_000))
    gaps = np.diff(d.arrivals, prepend=0.0)
    assert gaps.mean() == pytest.approx(0.2, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    assert (np.diff(d.arrivals) >= 0).all()


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_burstiness(cv):
    d = draw(workload(arrivals={"process": "gamma", "rate": 2.0, "cv": cv}, requests=50_000))
    gaps = np.diff(d.arrivals, prepend=0.0)
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_same_seed_same_draws_other_seed_differs():
    w = workload(arrivals={"process": "poisson", "rate": 1.0}, requests=100,
                 output_tokens={"dist": "uniform", "low": 1, "high": 1000})
    a, b, c = draw(w, 7), draw(w, 7), draw(w, 8)
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.output, b.output)
    assert not np.array_equal(a.output, c.output)


def test_length_distributions():
    n = 40_000
    fixed = draw(workload(arrivals={"process": "poisson", "rate": 1}, requests=n,
                          prompt_tokens={"dist": "fixed", "value": 77})).prompt
    assert (fixed == 77).all()
    uni = draw(workload(arrivals={"process": "poisson", "rate": 1}, requests=n,
                        prompt_tokens={"dist": "uniform", "low": 10, "high": 20})).prompt
    assert uni.min() == 10 and uni.max() == 20
    norm = draw(workload(arrivals={"process": "poisson", "rate": 1}, requests=n,
                         prompt_tokens={"dist": "normal", "mean": 5, "std": 10, "max": 30})).prompt
    assert norm.min() == 1 and norm.max() == 30  # clipped to [1, max]
    logn = draw(workload(arrivals={"process": "poisson", "rate": 1}, requests=n,
                         output_tokens={"dist": "lognormal", "mean": 300, "std": 200})).output
    assert logn.min() >= 1
    assert logn.mean() == pytest.approx(300, rel=0.03)
    assert logn.std() == pytest.approx(200, rel=0.08)


def test_empirical_lengths_from_file(tmp_path):
    (tmp_path / "lens.txt").write_text("# measured\n100, 200\n300\n")
    d = draw(workload(tmp_path, arrivals={"process": "poisson", "rate": 1}, requests=3000,
                      prompt_tokens={"dist": "empirical", "file": "lens.txt"}))
    assert set(d.prompt.tolist()) == {100, 200, 300}
    assert np.mean(d.prompt == 200) == pytest.approx(1 / 3, abs=0.03)


def test_replay_csv_with_lengths(tmp_path):
    (tmp_path / "trace.csv").write_text(
        "timestamp,prompt_tokens,output_tokens\n1500,10,3\n1000,20,4\n2500,30,5\n"
    )
    w = workload(tmp_path, arrivals={"process": "replay", "file": "trace.csv",
                                     "time_unit": "ms", "speedup": 2.0})
    d = draw(w)
    assert d.arrivals.tolist() == pytest.approx([0.0, 0.25, 0.75])  # sorted, shifted, halved
    assert d.prompt.tolist() == [20, 10, 30] and d.output.tolist() == [4, 3, 5]
    with pytest.raises(ValidationError, match="has only 3 rows"):
        workload(tmp_path, arrivals={"process": "replay", "file": "trace.csv"}, requests=9)


def test_replay_takes_the_first_requests_in_time_not_in_file_order(tmp_path):
    (tmp_path / "t.csv").write_text("arrival,prompt_tokens\n5.0,50\n1.0,10\n3.0,30\n2.0,20\n")
    d = draw(workload(tmp_path, arrivals={"process": "replay", "file": "t.csv"}, requests=2))
    assert d.arrivals.tolist() == [0.0, 1.0] and d.prompt.tolist() == [10, 20]


@pytest.mark.parametrize("dist", ["normal", "lognormal"])
def test_clipped_distributions_need_max_at_least_min(dist):
    with pytest.raises(ValidationError, match=r"max \(10\) must be >= min \(20\)"):
        workload(arrivals={"process": "poisson", "rate": 1.0},
                 prompt_tokens={"dist": dist, "mean": 15, "std": 5, "min": 20, "max": 10})


def test_replay_plain_times(tmp_path):
    (tmp_path / "times.txt").write_text("0\n0.5\n2\n")
    d = draw(workload(tmp_path, arrivals={"process": "replay", "file": "times.txt"},
                      output_tokens={"dist": "fixed", "value": 9}))
    assert d.arrivals.tolist() == [0.0, 0.5, 2.0] and d.output.tolist() == [9, 9, 9]


def test_closed_loop_keeps_concurrency():
    sc = Scenario.load_from_dict({
        "costs": {"table": {"prefill": 2.0, "decode": 1.0}},
        "workload": {"arrivals": {"process": "closed", "concurrency": 3, "think_time_s": 0.01},
                     "requests": 200, "output_tokens": {"dist": "uniform", "low": 1, "high": 50}},
    })
    tr = simulate(sc)
    events = sorted([(r.arrival, 1) for r in tr.requests] + [(r.finish, -1) for r in tr.requests],
                    key=lambda e: (e[0], e[1]))
    in_system = np.cumsum([e[1] for e in events])
    assert in_system.max() == 3
    by_id = sorted(tr.requests, key=lambda r: r.id)
    # request 3 is sent by the first client to finish, think time later
    assert by_id[3].arrival == pytest.approx(min(r.finish for r in by_id[:3]) + 0.01)


def test_acceptance_alpha_matches_leviathan():
    model = build_acceptance(Acceptance(alpha=0.6), k=4)
    assert model.expected_tokens() == pytest.approx(leviathan_tokens(0.6, 4))
    sample = model.sample(200_000, np.random.default_rng(0))
    assert sample.min() == 0 and sample.max() == 4
    assert sample.mean() + 1 == pytest.approx(leviathan_tokens(0.6, 4), rel=0.01)


def test_acceptance_per_position_rates():
    rates = [0.9, 0.5, 0.2]
    model = build_acceptance(Acceptance(per_position=rates + [0.7]), k=3)  # extra rate ignored
    assert model.pmf.tolist() == pytest.approx(pmf_from_rates(rates).tolist())
    s = model.sample(100_000, np.random.default_rng(1))
    # conditional acceptance of position 1 given position 0 was accepted
    assert np.mean(s[s >= 1] >= 2) == pytest.approx(0.5, abs=0.01)


def test_acceptance_trace_replay(tmp_path):
    (tmp_path / "acc.txt").write_text("0 1 1 2 6\n")
    acc = Acceptance.model_validate({"trace": "acc.txt"}, context={"base_dir": tmp_path})
    model = build_acceptance(acc, k=4)
    assert model.pmf.tolist() == pytest.approx([0.2, 0.4, 0.2, 0.0, 0.2])  # 6 counts as k=4


def test_a_drawn_request_longer_than_the_context_is_refused():
    from kestrel_sim.errors import ConfigError

    w = workload(arrivals={"process": "poisson", "rate": 1}, requests=2000,
                 prompt_tokens={"dist": "lognormal", "mean": 2000, "std": 3000})
    d = draw_workload(w, np.random.default_rng(0), context=100_000)  # the tail fits
    longest = int((d.prompt + d.output).max())
    with pytest.raises(ConfigError, match=f"more than the model's context of {longest - 1}"):
        draw_workload(w, np.random.default_rng(0), context=longest - 1)


def test_longest_request_a_workload_can_draw(tmp_path):
    (tmp_path / "lens.txt").write_text("[100,\n 700]\n")
    (tmp_path / "t.csv").write_text("arrival,output_tokens\n0,5\n1,50\n")
    w = workload(tmp_path, arrivals={"process": "poisson", "rate": 1},
                 prompt_tokens={"dist": "empirical", "file": "lens.txt"},
                 output_tokens={"dist": "normal", "mean": 50, "std": 9})
    assert w.longest() == (700, None)  # a normal without max is unbounded
    w = workload(tmp_path, arrivals={"process": "replay", "file": "t.csv"},
                 prompt_tokens={"dist": "uniform", "low": 3, "high": 9})
    assert w.longest() == (9, 50)  # the file's column overrides output_tokens


def test_requests_are_capped_with_a_reason():
    with pytest.raises(ValidationError, match="more than one run holds"):
        workload(arrivals={"process": "poisson", "rate": 1}, requests=10_000_001)
