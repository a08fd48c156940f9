"""Measured sequences, replayed per request: a Profile's `acceptance.sequences` (one agreement
string per measured sequence: kestrel_sim/measured_acceptance.py) schema-checked against its
counts, and the simulator's replay (kestrel_sim/sequence_acceptance.py): the exact lengths a
bit string gives at any k, the pooled mean from alike sequences, a wider per-request spread
from unlike ones, one seed one run, and `spec.acceptance.per_request` to choose."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from accepted_lengths import per_request
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kestrel_sim import simulate
from kestrel_sim.acceptance import (
    WINDOW,
    RequestAcceptance,
    describe_acceptance,
    pmf_from_rates,
)
from kestrel_sim.measured_acceptance import MeasuredAcceptance, agreement, round_lengths
from kestrel_sim.metrics import Metrics
from kestrel_sim.profile import Profile
from kestrel_sim.scenario import Scenario
from kestrel_sim.sequence_acceptance import (
    Sequence,
    SequenceAcceptance,
    replay,
    request_acceptance,
    sequence_choice,
)

ROOT = Path(__file__).resolve().parents[2]
ORGANIC_PROFILE = ROOT / "calibration" / "profiles" / "qwen3-0.6b-organic_h200.json"
PAIR = {"draft_model": "qwen3-0.6b", "draft_quant": "int4-last-14", "device": "NVIDIA H200",
        "draft_device": "gpu", "dtype": "bfloat16", "backend": "cupy+graphs",
        "prompt_tokens": 512}
K = 8  # the measurement's k


def block_of(per_sequence: list[list[int]], k: int = K, **changes) -> MeasuredAcceptance:
    """The block of sequences that kept per_sequence[j][r] in round r (k proposals each)."""
    rounds = len(per_sequence[0])
    lengths = [n for r in range(rounds) for n in (seq[r] for seq in per_sequence)]
    return MeasuredAcceptance.from_lengths(
        lengths, k, prompts=len(per_sequence), rounds=rounds,
        sequences=[agreement(seq, k) for seq in per_sequence], **(PAIR | changes))


def profile_with(tmp_path: Path, block: MeasuredAcceptance | None, name: str = "p.json"
                 ) -> Path:
    path = tmp_path / name
    Profile.load(ORGANIC_PROFILE).model_copy(update={"acceptance": block}).save(path)
    return path


def old_profile(tmp_path: Path) -> Path:
    """The bundled pair's profile as calibrations before 75676d9 wrote it: no sequences."""
    block = Profile.load(ORGANIC_PROFILE).acceptance
    return profile_with(tmp_path, block.model_copy(update={"sequences": None}), "old.json")


def scenario(profile: Path, per_request: str | None = None, k: int = 4, requests: int = 120,
             seed: int = 3, output: int = 96) -> Scenario:
    acceptance = {"from_profile": str(profile)}
    if per_request is not None:
        acceptance["per_request"] = per_request
    return Scenario.load_from_dict({
        "hardware": "h200", "model": "qwen3-0.6b",
        "draft": {"model": "qwen3-0.6b", "quant": "int4-last-14", "device": "gpu"},
        "spec": {"k": k, "acceptance": acceptance}, "costs": {"profile": str(ORGANIC_PROFILE)},
        "workload": {"arrivals": {"process": "poisson", "rate": 20.0}, "requests": requests,
                     "prompt_tokens": {"dist": "fixed", "value": 128},
                     "output_tokens": {"dist": "fixed", "value": output}, "seed": seed}})


def drawn_lengths(rates, count: int, rng) -> list[int]:
    """`count` lengths drawn from per-position rates (what independent rounds would keep)."""
    return rng.choice(len(rates) + 1, size=count, p=pmf_from_rates(rates)).tolist()


RATES = [0.6, 0.8, 0.9, 0.9, 0.95, 0.95, 0.95, 0.97]


# --- the agreement string ---------------------------------------------------------------

def test_a_round_writes_its_ones_then_a_correction_or_an_unknown_bonus():
    assert agreement([0, 2, 4, 1], 4) == "0" + "110" + "1111?" + "10"
    assert round_lengths("0110" + "1111?" + "10", 4) == [0, 2, 4, 1]
    assert agreement([1, 1], 1) == "1?1?"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8).flatmap(
    lambda k: st.tuples(st.just(k), st.lists(st.integers(0, k), min_size=1, max_size=40))))
def test_round_lengths_read_back_what_agreement_wrote(case):
    k, lengths = case
    bits = agreement(lengths, k)
    assert round_lengths(bits, k) == lengths
    assert len(bits) == sum(lengths) + len(lengths)  # n accepted + 1 emitted a round
    assert bits.count("?") == lengths.count(k)


@pytest.mark.parametrize(("bits", "where"), [("1101", "ends inside a round"),
                                             ("1111", "character 3 is '1' after 3"),
                                             ("10?", r"character 2 is '\?' after 0"),
                                             ("1x0", "character 1 is 'x'")])
def test_round_lengths_refuse_what_rounds_at_k_cannot_write(bits, where):
    with pytest.raises(ValueError, match=where):
        round_lengths(bits, 3)


# --- the schema -------------------------------------------------------------------------

def test_the_block_keeps_its_sequences_through_a_profile(tmp_path):
    rng = np.random.default_rng(0)
    block = block_of([drawn_lengths(RATES, 6, rng) for _ in range(4)])
    assert len(block.sequences) == 4 and all(len(round_lengths(s, K)) == 6
                                             for s in block.sequences)
    assert Profile.load(profile_with(tmp_path, block)).acceptance == block
    old = Profile.load(old_profile(tmp_path)).acceptance
    assert old is not None and old.sequences is None
    bundled = Profile.load(ORGANIC_PROFILE).acceptance  # the bundled one: one a prompt
    assert len(bundled.sequences) == bundled.prompts


@pytest.mark.parametrize(("change", "error"), [
    (lambda s: s[:-1], "sequences has 3 strings: expected one per prompt"),
    (lambda s: [s[0] + "0", *s[1:]], r"sequences\[0\] holds 7 rounds: expected rounds = 6"),
    (lambda s: [s[0] + "2", *s[1:]], r"sequences\[0\]: character .* is '2'"),
    (lambda s: [s[1], s[1], *s[2:]], "sequences count reached"),
])
def test_sequences_that_do_not_fit_the_counts_are_refused(change, error):
    per_sequence = [[0, 1, 2, 3, 8, 0], [8, 8, 8, 8, 8, 8], [0, 0, 0, 0, 0, 0],
                    [5, 5, 5, 5, 5, 5]]
    data = block_of(per_sequence).model_dump()
    data["sequences"] = change(data["sequences"])
    with pytest.raises(ValidationError, match=error):
        MeasuredAcceptance.model_validate(data)


# --- the replay -------------------------------------------------------------------------

def reference(bits: str, unknown: int, k: int, rounds: int) -> list[int]:
    """Rounds at k over `bits` with each '?' read as `unknown` and `unknown`s past the end,
    walked the plain way: the run of '1's from the round's start, at most k."""
    known = [unknown if c == "?" else int(c) for c in bits]
    out, cursor = [], 0
    for _ in range(rounds):
        n = 0
        while n < k and (known[cursor + n] if cursor + n < len(known) else unknown):
            n += 1
        out.append(n)
        cursor += n + 1
    return out


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(0, K), min_size=1, max_size=30),
       k=st.sampled_from([1, 2, 4, 8]), unknown=st.sampled_from([0, 1]))
def test_the_replay_accepts_the_run_of_ones_from_its_cursor(lengths, k, unknown):
    """Rates of 0 or 1 make every unknown bit certain: the replay's lengths are then exactly
    the bits', at any k, also past the end of the string."""
    bits = agreement(lengths, K)
    seq = Sequence(bits, [float(unknown)] * K)
    rounds = len(bits) + 3
    uniforms = np.random.default_rng(1).random(rounds).tolist()
    got, _ = replay(seq, 0, uniforms, k)
    assert got == reference(bits, unknown, k, rounds)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, K), min_size=1, max_size=30))
def test_at_the_measured_k_the_replay_is_the_measurement(lengths):
    """At k = K every round starts where a measured one did: the bonus '?' is never asked."""
    seq = Sequence(agreement(lengths, K), [0.5] * K)
    got, cursor = replay(seq, 0, np.random.default_rng(2).random(len(lengths)).tolist(), K)
    assert got == lengths and cursor == len(seq.bits)


def test_unknown_bits_are_drawn_at_their_rates():
    """Past the end, offset i of a round agrees at rates[i]: the pooled per-position law."""
    seq = Sequence("0", RATES)
    uniforms = np.random.default_rng(3).random(40_000).tolist()
    got, _ = replay(seq, 1, uniforms, 4)  # every round past the end
    freq = np.bincount(got, minlength=5) / len(got)
    assert np.allclose(freq, pmf_from_rates(RATES[:4]), atol=0.01)


def test_each_sequence_serves_as_many_requests_and_a_seed_fixes_which():
    choice = sequence_choice(5, 100, 8)
    assert sorted(np.bincount(choice, minlength=8)) == [12] * 4 + [13] * 4
    assert sorted(choice[:8]) == list(range(8))
    assert (sequence_choice(5, 30, 8) == choice[:30]).all()  # request r's, whatever n
    assert (sequence_choice(6, 100, 8) != choice).any()


def test_a_preempted_request_resumes_its_sequence_where_it_was():
    rng = np.random.default_rng(4)
    block = block_of([drawn_lengths(RATES, 64, rng) for _ in range(4)])
    whole = SequenceAcceptance(block, None, 4, seed=9, n=3)
    first = whole.window(1)
    whole.used[1] = WINDOW  # all its rounds taken
    second = whole.window(1)
    resumed = SequenceAcceptance(block, None, 4, seed=9, n=3)
    resumed.window(1)
    resumed.used[1] = 50  # 50 of its rounds taken, then preempted
    assert (resumed.window(1) == np.concatenate((first, second))[50: 50 + WINDOW]).all()


# --- the simulator ----------------------------------------------------------------------

def test_alike_sequences_give_the_pooled_mean(tmp_path):
    """At the measured k (rounds start where the measured ones did)."""
    rng = np.random.default_rng(5)
    block = block_of([drawn_lengths(RATES, 64, rng) for _ in range(32)])
    path = profile_with(tmp_path, block)
    measured = simulate(scenario(path, k=K), trace="full")
    pooled = simulate(scenario(path, "pooled", k=K), trace="full")
    m, p = (r.metrics.spec_decode_acceptance_length for r in (measured, pooled))
    assert m == pytest.approx(p, rel=0.04)
    assert m == pytest.approx(block.acceptance_length(), rel=0.04)


def test_a_smaller_k_starts_rounds_inside_runs(tmp_path):
    """Below the measured k, a round after one that kept all k starts inside a run of
    agreement (here at rates 0.95 and up), which the first k pooled rates price as a round's
    first position (0.6): the replay accepts more (sequence_acceptance.py)."""
    rng = np.random.default_rng(5)
    block = block_of([drawn_lengths(RATES, 64, rng) for _ in range(32)])
    path = profile_with(tmp_path, block)
    m, p = (simulate(scenario(path, mode, requests=400)).metrics.spec_decode_acceptance_length
            for mode in ("measured", "pooled"))
    assert m == pytest.approx(3.4, abs=0.1) and p == pytest.approx(2.8, abs=0.1)


def test_unlike_sequences_spread_the_requests_the_pooled_rates_do_not(tmp_path):
    """Half the sequences always agree, half never: each request keeps 4 or 0 a round
    replayed, about 2 drawn from the pooled rates (the same counts)."""
    block = block_of([[K] * 128] * 4 + [[0] * 128] * 4)  # 128 rounds: past any output
    path = profile_with(tmp_path, block)
    means = {}
    for mode in ("measured", "pooled"):
        run = simulate(scenario(path, mode, requests=64), trace="full")
        means[mode] = np.array([np.mean(v[:-1]) for v in per_request(run).values()])
    assert sorted(set(means["measured"].round(6))) == [0.0, 4.0]  # a sequence each
    assert np.std(means["measured"]) > 1.9 and np.std(means["pooled"]) < 0.5
    assert np.mean(means["pooled"]) == pytest.approx(2.0, abs=0.3)


def test_a_seed_gives_one_run(tmp_path):
    rng = np.random.default_rng(6)
    block = block_of([drawn_lengths(RATES, 32, rng) for _ in range(8)])
    path = profile_with(tmp_path, block)
    a, b = (per_request(simulate(scenario(path), trace="full")) for _ in range(2))
    other = per_request(simulate(scenario(path, seed=4), trace="full"))
    assert a == b and a != other


def test_per_request_says_what_is_used_and_refuses_what_cannot_be(tmp_path):
    rng = np.random.default_rng(7)
    path = profile_with(tmp_path, block_of([drawn_lengths(RATES, 8, rng) for _ in range(4)]))
    acc = scenario(path).spec.acceptance
    assert acc.sequences() is not None
    assert "replays one of its 4 measured sequences" in describe_acceptance(acc, 4)
    pooled = scenario(path, "pooled").spec.acceptance
    assert pooled.sequences() is None and "pooled (these rates" in describe_acceptance(pooled)
    old = scenario(old_profile(tmp_path)).spec.acceptance  # a profile without sequences
    assert old.sequences() is None and "holds no measured sequences" in describe_acceptance(old)
    with pytest.raises(ValidationError, match="per_request: measured, but profile"):
        scenario(old_profile(tmp_path), "measured")
    with pytest.raises(ValidationError, match="per_request"):
        scenario(path, "sometimes")
    with pytest.raises(ValidationError, match="per_request: pooled only applies to from_pro"):
        Scenario.load_from_dict({"hardware": "h200", "model": "qwen3-0.6b",
                                 "draft": {"model": "qwen3-0.6b"},
                                 "spec": {"k": 4, "acceptance": {"alpha": 0.6,
                                                                 "per_request": "pooled"}}})
    assert "per_request" not in scenario(path).model_dump()["spec"]["acceptance"]


def test_an_old_profile_still_simulates_with_the_pooled_rates(tmp_path):
    sc = scenario(old_profile(tmp_path), requests=20)
    assert type(request_acceptance(sc.spec.acceptance, 4, 3, 20)) is RequestAcceptance
    assert simulate(sc).metrics.completed == 20


# --- `kestrel run` on the validation suite's organic scenario ---------------------------

ORGANIC = ROOT / "scenarios" / "validation" / "spec-organic-int4-copy.yaml"


def dealt_sequences(block: MeasuredAcceptance, rng) -> list[str]:
    """Sequences for `block`'s very counts: its lengths, sorted and dealt a sequence's rounds
    at a time (the first sequence the lowest: as unlike as they can be), each shuffled."""
    k = block.k
    counts = [r - a for r, a in zip(block.reached, block.accepted)] + [block.accepted[-1]]
    lengths = np.repeat(np.arange(k + 1), counts).reshape(block.prompts, block.rounds)
    return [agreement(rng.permutation(row).tolist(), k) for row in lengths]


def test_kestrel_run_replays_the_profiles_sequences_where_it_has_them(tmp_path):
    from typer.testing import CliRunner

    from kestrel_cli.app import app

    def run(*args: str):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        result = CliRunner().invoke(app, ["run", str(ORGANIC), "--on", "sim", "-o", str(out),
                                          "--set", "workload.requests=60", *args])
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        return text, (out / "metrics.json").read_text()

    bundled, _ = run()  # the bundled profile: its 64 measured sequences
    assert "per request: replays one of its 64 measured sequences" in bundled
    old, _ = run("--set", f"spec.acceptance.from_profile={old_profile(tmp_path)}")
    assert "per request: pooled (the profile holds no measured sequences)" in old
    block = Profile.load(ORGANIC_PROFILE).acceptance
    block = MeasuredAcceptance.model_validate(  # checked against the counts
        block.model_dump() | {"sequences": dealt_sequences(block, np.random.default_rng(0))})
    path = profile_with(tmp_path, block)
    replayed, metrics = run("--set", f"spec.acceptance.from_profile={path}")
    assert "per request: replays one of its 64 measured sequences" in replayed
    pooled, pooled_metrics = run("--set", f"spec.acceptance.from_profile={path}",
                                 "--set", "spec.acceptance.per_request=pooled")
    assert "per request: pooled (these rates, by choice)" in pooled
    std = [Metrics.model_validate_json(m).std_tpot_ms for m in (metrics, pooled_metrics)]
    assert std[0] > 2 * std[1]  # unlike sequences: requests differ
