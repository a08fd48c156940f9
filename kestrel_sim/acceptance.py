"""Acceptance models: how many of k draft tokens the target accepts in one round.

Every model reduces to a distribution over 0..k accepted tokens, sampled by inverse CDF
with one uniform per request per round from that request's own Generator,
accept_rng(seed, request), in the simulator (RequestAcceptance) and in the runtime's
controlled mode (kestrel_rt/spec/controlled.py) alike, so a request draws the same lengths
on both, whichever requests share its batch:

- alpha:        P(n) = alpha^n (1 - alpha) for n < k, P(k) = alpha^k (independent tokens)
- per_position: p_i = P(position i accepted | positions before it accepted);
                P(n) = p_0 ... p_{n-1} (1 - p_n), P(k) = p_0 ... p_{k-1}
- trace:        frequencies of measured accepted lengths (values above k count as k)
- from_profile: per_position, the rates a calibration measured for the pair on the device
                (kestrel_sim/measured_acceptance.py); where the profile holds each measured
                sequence's agreement, the simulator replays one sequence per request instead
                (kestrel_sim/sequence_acceptance.py; spec.acceptance.per_request: pooled
                keeps the rates), so requests differ as the measured ones did

Leviathan et al.'s expected tokens per round, (1 - alpha^(k+1)) / (1 - alpha), equals
`expected_tokens()` for the alpha model; it is a check, not the model.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.datafiles import read_numbers
from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import Acceptance

SEED_RANGE = 2**64  # seeds are taken mod 2**64, as torch.Generator.manual_seed takes them
WINDOW = 128  # drawn lengths a running batch holds per row before it draws the next ones


def accept_rng(seed: int | None, request: int) -> np.random.Generator:
    """Request `request`'s generator of accepted lengths, seeded (seed + request) mod 2**64
    as its sampling generator is (fresh entropy when seed is None)."""
    return np.random.default_rng(None if seed is None else (seed + request) % SEED_RANGE)


class AcceptanceModel:
    __slots__ = ("cdf", "k", "pmf")

    def __init__(self, pmf: np.ndarray):
        pmf = np.asarray(pmf, dtype=float)
        self.pmf = pmf / pmf.sum()
        self.k = len(pmf) - 1
        self.cdf = np.cumsum(self.pmf)
        self.cdf[-1] = np.inf  # a uniform in [0, 1) always lands

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """[n] accepted draft tokens per request, each in 0..k."""
        return np.searchsorted(self.cdf, rng.random(n), side="right")

    def expected_accepted(self) -> float:
        return float(np.dot(np.arange(self.k + 1), self.pmf))

    def expected_tokens(self) -> float:
        """Tokens per round with an uncapped output: accepted + 1 (correction or bonus)."""
        return self.expected_accepted() + 1.0


class RequestAcceptance:
    """Each request's accepted lengths from its own stream: its j-th round takes the j-th
    uniform of accept_rng(seed, request). `used` [n] counts the rounds each request has
    drawn, so one preempted or moved to another worker resumes its stream where it was.
    Live requests keep their generator between windows (made once: seeding costs more
    than drawing); finish() lets it go."""

    __slots__ = ("drawn", "live", "model", "seed", "used")

    def __init__(self, model: AcceptanceModel, seed: int, n: int):
        self.model = model
        self.seed = seed
        self.used = np.zeros(n, dtype=np.int64)  # [n] rounds drawn per request
        self.drawn = np.zeros(n, dtype=np.int64)  # [n] uniforms its live generator gave
        self.live: dict[int, np.random.Generator] = {}

    def window(self, request: int) -> np.ndarray:
        """[WINDOW] int8: the request's accepted lengths for its next WINDOW rounds. A
        request whose last window went partly unused (preempted) restarts its generator
        past the `used` uniforms (one 64-bit step each)."""
        rng = self.live.get(request)
        used = int(self.used[request])
        if rng is None or self.drawn[request] != used:
            rng = self.live[request] = accept_rng(self.seed, request)
            if used:
                rng.bit_generator.advance(used)
        self.drawn[request] = used + WINDOW
        return self.model.sample(WINDOW, rng).astype(np.int8)

    def finish(self, requests) -> None:
        """Requests that emitted their last token: their generators go."""
        for r in requests:
            self.live.pop(r, None)


def leviathan_tokens(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens per round for i.i.d. acceptance."""
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def pmf_from_rates(rates) -> np.ndarray:
    """Distribution of accepted length from conditional per-position rates (len = k)."""
    k = len(rates)
    pmf = np.empty(k + 1)
    alive = 1.0
    for i, p in enumerate(rates):
        pmf[i] = alive * (1.0 - p)
        alive *= p
    pmf[k] = alive
    return pmf


def build_acceptance(acc: Acceptance, k: int) -> AcceptanceModel:
    if acc.alpha is not None:
        return AcceptanceModel(pmf_from_rates([acc.alpha] * k))
    rates = acc.rates(k)  # per_position, or from_profile's measured rates
    if rates is not None:
        if len(rates) < k:
            raise ConfigError(f"spec.acceptance has {len(rates)} per-position rates "
                              f"({describe_acceptance(acc)}) but k is {k}")
        return AcceptanceModel(pmf_from_rates(rates))
    values = read_numbers(acc.trace, "acceptance trace")
    if (values < 0).any() or (values != np.rint(values)).any():
        raise ConfigError(
            f"acceptance trace {acc.trace}: accepted lengths must be integers >= 0"
        )
    counts = np.bincount(np.minimum(values.astype(np.int64), k), minlength=k + 1)
    return AcceptanceModel(counts.astype(float))


def describe_acceptance(acc: Acceptance, k: int | None = None) -> str:
    """Where a scenario's accepted lengths come from, in a line (the run's header)."""
    if acc.alpha is not None:
        text = f"alpha {acc.alpha:g} per token (given)"
    elif acc.per_position is not None:
        text = _per_position(acc.per_position, k) + " (given)"
    elif acc.trace is not None:
        text = f"accepted lengths replayed from {acc.trace}"
    elif acc.measured is not None:
        path, block = acc.measured
        text = (_per_position(block.conditional_rates, k)
                + f", {block.describe()}, from profile {path}")
        sequences = acc.sequences()
        if sequences is not None:
            tokens = sum(map(len, sequences)) / len(sequences)
            text += (f"; per request: replays one of its {len(sequences)} measured sequences "
                     f"(~{tokens:.0f} tokens each; past the end, its own rates)")
        elif block.sequences is not None:
            text += "; per request: pooled (these rates, by choice)"
        else:
            text += "; per request: pooled (the profile holds no measured sequences)"
    else:
        text = "from a profile (not resolved)"
    if acc.on_hardware == "organic":
        text += "; on hardware: organic (what the target accepts)"
    elif acc.on_hardware == "controlled":
        text += "; on hardware: controlled (drawn from these rates)"
    return text


def _per_position(rates, k: int | None) -> str:
    """"per position 0.63 0.81 ...": the first k rates (all where k is None)."""
    return "per position " + " ".join(f"{r:.2f}" for r in (rates[:k] if k else rates))
