"""Speculative decoding statistics, under vLLM's names.

A *draft* is one sequence's proposal in one round; it proposes `proposed` tokens (k, or
fewer for a sequence near its end: at most what it may still emit minus the correction
token) and the target accepts the first `accepted` of them. Counted from the tokens actually
accepted:

- spec_decode_num_drafts: drafts with at least one proposed token
- spec_decode_draft_tokens / spec_decode_accepted_tokens: sums over drafts
- spec_decode_acceptance_length: 1 + accepted / drafts (tokens per round, with the bonus)
- spec_decode_acceptance_rate: 100 * accepted / draft tokens (a percentage)
- spec_decode_per_position_acceptance_rates[i]: of the drafts that proposed position i, the
  fraction that had it accepted (vLLM's accepted-at-i over drafts; kestrel_sim.metrics'
  "fraction of rounds accepting > i drafts")
- conditional_rates()[i]: P(position i accepted | positions 0..i-1 accepted), the quantity
  kestrel_sim's `per_position` acceptance (and alpha, for every i) specifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    k: int
    controlled: bool = False  # accepted lengths drawn from a given alpha / rates, not judged
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)  # [k] drafts proposing position i
    reached_at: list[int] = field(default_factory=list)  # [k] ... whose 0..i-1 were accepted
    accepted_at: list[int] = field(default_factory=list)  # [k] ... with position i accepted

    def __post_init__(self) -> None:
        for name in ("proposed_at", "reached_at", "accepted_at"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.k)

    def record(self, proposed: int, accepted: int) -> None:
        """One sequence's draft in one round: `proposed` tokens, the first `accepted` kept."""
        if not 0 <= accepted <= proposed <= self.k:
            raise ValueError(f"a draft of {proposed} tokens (k={self.k}) cannot accept "
                             f"{accepted}")
        if proposed == 0:
            return
        self.num_drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.reached_at[i] += i <= accepted
            self.accepted_at[i] += i < accepted

    def merged(self, other: SpecStats) -> SpecStats:
        """Both sets of drafts counted together (the workers of one run)."""
        return SpecStats(
            self.k, self.controlled, self.num_drafts + other.num_drafts,
            self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
            *([a + b for a, b in zip(getattr(self, n), getattr(other, n))]
              for n in ("proposed_at", "reached_at", "accepted_at")))

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Percent of draft tokens accepted."""
        return 100.0 * self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def per_position_rates(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def conditional_rates(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at)]

    def as_dict(self) -> dict:
        """The JSON block `kestrel generate --draft ... --json` adds."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_draft_tokens": self.draft_tokens,
            "spec_decode_accepted_tokens": self.accepted_tokens,
            "spec_decode_acceptance_length": self.acceptance_length,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_per_position_acceptance_rates": self.per_position_rates(),
            "spec_decode_k": self.k,
            "spec_decode_controlled": self.controlled,
        }
