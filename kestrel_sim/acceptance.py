"""Acceptance models: how many of k draft tokens the target accepts in one round.

Every model reduces to a distribution over 0..k accepted tokens, sampled by inverse CDF
from the scenario's Generator (one uniform per request per round):

- alpha:        P(n) = alpha^n (1 - alpha) for n < k, P(k) = alpha^k (independent tokens)
- per_position: p_i = P(position i accepted | positions before it accepted);
                P(n) = p_0 ... p_{n-1} (1 - p_n), P(k) = p_0 ... p_{k-1}
- trace:        frequencies of measured accepted lengths (values above k count as k)

Leviathan et al.'s expected tokens per round, (1 - alpha^(k+1)) / (1 - alpha), equals
`expected_tokens()` for the alpha model; it is a check, not the model.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.datafiles import read_numbers
from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import Acceptance


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
    if acc.per_position is not None:
        return AcceptanceModel(pmf_from_rates(acc.per_position[:k]))
    values = read_numbers(acc.trace, "acceptance trace")
    if (values < 0).any() or (values != np.rint(values)).any():
        raise ConfigError(
            f"acceptance trace {acc.trace}: accepted lengths must be integers >= 0"
        )
    counts = np.bincount(np.minimum(values.astype(np.int64), k), minlength=k + 1)
    return AcceptanceModel(counts.astype(float))
