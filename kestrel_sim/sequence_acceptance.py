"""Per-request acceptance replayed from measured sequences: each request gets one of the
agreement strings a calibration recorded (kestrel_sim/measured_acceptance.py) and walks it.

Greedy speculative decoding emits the target's greedy tokens, and the draft given the true
prefix proposes the same token at a position whatever k is, so a string of one bit per
generated position after the first ('1' agreed, '0' did not) gives every round at any k:
a round that starts at position s with k proposals accepts the run of '1's from s, at most
k, and emits n + 1 tokens, so the next round starts at s + n + 1. Requests then differ as the
measured sequences did; independent draws from the pooled per-position rates make every
request alike (kestrel_sim/acceptance.py pmf_from_rates).

    streams = request_acceptance(acc, k, seed, n)   # what the engine gives the batch
    lengths = streams.window(request)              # [WINDOW] its next accepted lengths

Which sequence: request r of a run takes sequence choice[r], the sequences dealt in a fresh
random order to each run of as many requests as there are sequences (every sequence serves
as many requests, give or take one), from a generator of the workload seed alone, so a seed
reproduces the choice whatever the batches.

Bits a sequence does not give are drawn, one uniform per round from the request's own
stream accept_rng(seed, request) as the pooled model draws (round j takes the j-th uniform:
a preempted request resumes where it was), a uniform u deciding bit after bit (u < p: a '1',
and u / p is again uniform for the next; else a '0' and the round ends):

- '?' (a bonus position: the draft never proposed there) with the sequence's own rate at the
  measurement's last position, K - 1: a '?' follows K agreeing positions, and the rate that
  conditions on the longest run of agreement is the one nearest to it;
- past the string's end, at offset i of the round, with the sequence's own rate at position
  i, so a request that outlives its sequence keeps agreeing about as that sequence did
  (the pooled rates would pull every long request to the mean, the spread this replays).

A sequence's own rate at position i is accepted / reached of its own rounds, shrunk toward
the pooled rate by PRIOR_DRAFTS drafts at that rate, (a + m p) / (r + m): a position the
sequence reached a few times, or never, leans on the pool.

At the measured k, K, a replayed round starts where a measured one did, so alike sequences
give the pooled rates' mean. At a smaller k they need not: after a round that kept all k the
next starts inside a run of agreement, where agreeing is likelier than at a round's first
position after a correction, while the first k pooled rates price every round's first
position alike (sequences drawn round by round at K = 8 from rates 0.6 0.8 0.9 0.9 0.95 ...
replay at ~3.4 tokens a round at k = 4, where the first 4 rates give ~2.8: tests/sim/
test_acceptance_sequences.py test_a_smaller_k_starts_rounds_inside_runs). The replay is
the consistent one: agreement is a fact of a position, not of a round.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.acceptance import (
    SEED_RANGE,
    WINDOW,
    AcceptanceModel,
    RequestAcceptance,
    accept_rng,
    build_acceptance,
)
from kestrel_sim.measured_acceptance import (
    UNKNOWN,
    MeasuredAcceptance,
    count_positions,
    ratio,
    round_lengths,
)
from kestrel_sim.scenario import Acceptance

PRIOR_DRAFTS = 4  # a sequence's own rates lean on the pooled ones by this many drafts
CHOICE_STREAM = 1  # the choice generator is seeded (seed, CHOICE_STREAM): apart from any
#                    request's accept_rng(seed, request), which is seeded by one integer


class Sequence:
    """One measured agreement string, ready to replay: bits (1, 0, or -1 for '?'), run[p]
    the '1's from position p on (known ones only), and the rates its unknown bits are drawn
    with: rates[i] at offset i of a round past its end, rates[-1] for a '?'."""

    __slots__ = ("bits", "rates", "run")

    def __init__(self, text: str, rates: list[float]):
        self.bits = [-1 if c == UNKNOWN else int(c) for c in text]
        run, ones = [0] * len(self.bits), 0
        for p in range(len(self.bits) - 1, -1, -1):
            ones = ones + 1 if self.bits[p] == 1 else 0
            run[p] = ones
        self.run = run
        self.rates = rates


def own_rates(text: str, block: MeasuredAcceptance) -> list[float]:
    """[K] a sequence's own conditional rates, shrunk toward the block's (the module)."""
    reached, accepted = count_positions(round_lengths(text, block.k), block.k)
    return [ratio(a + PRIOR_DRAFTS * p, r + PRIOR_DRAFTS)
            for a, r, p in zip(accepted, reached, block.conditional_rates)]


def replay(seq: Sequence, cursor: int, uniforms: list[float], k: int) -> tuple[list[int], int]:
    """(accepted lengths of one round per uniform, each 0..k; the position after them) of
    rounds of k proposals walking `seq` from position `cursor`."""
    bits, run, rates, end = seq.bits, seq.run, seq.rates, len(seq.bits)
    out = []
    for u in uniforms:
        i = run[cursor] if cursor < end else 0  # the known '1's: accepted for sure
        while i < k:
            p = cursor + i
            bit = bits[p] if p < end else None
            if bit == 1:
                i += 1
                continue
            if bit == 0:  # the draft proposed another token: the correction
                break
            rate = rates[-1] if bit is not None else rates[i]  # '?', or past the end
            if u >= rate:
                break
            u /= rate
            i += 1
        n = min(i, k)
        out.append(n)
        cursor += n + 1
    return out, cursor


def sequence_choice(seed: int | None, n: int, count: int) -> np.ndarray:
    """[n] the sequence each request replays: each run of `count` requests a permutation of
    the sequences (request r's choice is the same for any n)."""
    rng = np.random.default_rng(None if seed is None else [seed % SEED_RANGE, CHOICE_STREAM])
    blocks = -(-n // count)
    return np.argsort(rng.random((blocks, count)), axis=1).ravel()[:n]


class SequenceAcceptance(RequestAcceptance):
    """RequestAcceptance's interface (window, used, finish) over replayed sequences; `model`
    is the pooled rates' model (what per_request: pooled would draw from)."""

    __slots__ = ("choice", "cursor", "k", "sequences")

    def __init__(self, block: MeasuredAcceptance, model: AcceptanceModel, k: int, seed: int,
                 n: int):
        super().__init__(model, seed, n)
        self.k = k
        self.sequences = [Sequence(text, own_rates(text, block))
                          for text in block.sequences]
        self.choice = sequence_choice(seed, n, len(self.sequences))  # [n]
        self.cursor: dict[int, int] = {}  # live requests: the position their window ends at

    def window(self, request: int) -> np.ndarray:
        """[WINDOW] int8: the request's accepted lengths for its next WINDOW rounds. A request
        whose last window went partly unused (preempted) walks its sequence again from the
        start over its `used` rounds, with the same uniforms."""
        seq = self.sequences[self.choice[request]]
        rng = self.live.get(request)
        used = int(self.used[request])
        if rng is None or self.drawn[request] != used:
            rng = self.live[request] = accept_rng(self.seed, request)
            _, self.cursor[request] = replay(seq, 0, rng.random(used).tolist(), self.k)
        lengths, self.cursor[request] = replay(seq, self.cursor[request],
                                               rng.random(WINDOW).tolist(), self.k)
        self.drawn[request] = used + WINDOW
        return np.array(lengths, dtype=np.int8)

    def finish(self, requests) -> None:
        super().finish(requests)
        for r in requests:
            self.cursor.pop(r, None)


def request_acceptance(acc: Acceptance, k: int, seed: int, n: int) -> RequestAcceptance:
    """Each of `n` requests' accepted lengths: replayed from the profile's measured sequences
    where the scenario takes them (Acceptance.sequences), else drawn from the model."""
    model = build_acceptance(acc, k)
    if acc.sequences() is None:
        return RequestAcceptance(model, seed, n)
    return SequenceAcceptance(acc.measured[1], model, k, seed, n)

