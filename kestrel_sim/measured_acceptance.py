"""A draft pair's acceptance as calibration measured it on the device: the Profile's optional
`acceptance` block, and the checks a scenario's `spec.acceptance: {from_profile: ...}` makes
of it (kestrel_sim/speculation_spec.py resolves it).

`kestrel calibrate` with an organic draft (--draft-quant: a quantized copy of the target)
runs greedy speculative rounds of the pair as serving builds it (same device, dtype and
backend: bf16 cupy on a GPU, the torch backend on a CPU; calibration/acceptance.py) and
records, per draft position i = 0..k-1 (the scenario's positions 1..k):

  reached[i]   drafts (one sequence's proposal in one round) whose positions 0..i-1 were
               all accepted: the samples behind rate i
  accepted[i]  ... that had position i accepted too
  conditional_rates[i] = accepted[i] / reached[i] (0 where nothing reached position i):
               P(position i accepted | positions before it accepted), the quantity a
               scenario's `per_position` acceptance gives

Every draft proposes k tokens (the sequences have room for them), so reached[0] = drafts and
reached[i + 1] = accepted[i]. A scenario at k' <= k takes the first k' rates: whether a
greedy draft's position i is accepted does not depend on the positions after it (though
rounds at k' start at other positions than rounds at k: the sequences below need no such
reading).

The same rounds say more than the pooled rates: how each sequence agreed, position by
position (the optional `sequences`, one string per prompt; profiles measured before it have
none). Greedy speculative decoding emits the target's own greedy tokens, and the draft given
the true prefix proposes the same token at a position whatever k is, so one bit per
generated position after the first describes a sequence's acceptance at any k:

  '1'  the draft, given the true prefix, proposed the target's token there
  '0'  it did not: the round's correction token (a round that kept n < k wrote n '1's, '0')
  '?'  it never proposed there: the bonus token after a round that kept all k ('1' x k, '?')

so a string is its rounds' strings one after the other, and its rounds' accepted lengths
(round_lengths) count into reached and accepted as above. The simulator replays one
sequence per request (kestrel_sim/sequence_acceptance.py): measured acceptance differs from
sequence to sequence far more than independent draws from the pooled rates do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kestrel_sim.quant_spec import check_quant

RATE_DIGITS = 6  # conditional_rates are stored rounded to this many decimals
UNKNOWN = "?"  # a bonus position in an agreement string: the draft never proposed there


class MeasuredAcceptance(BaseModel):
    """A Profile's `acceptance` block: see the module docstring."""

    model_config = ConfigDict(extra="forbid")

    draft_model: str = Field(description="the draft, as the fingerprint's draft_model")
    draft_quant: Annotated[str, AfterValidator(check_quant)] = Field(
        description="the draft's weights: none, int8, int4 or int4-last-N")
    device: str = Field(description="where the target ran (GPU name, or the host CPU)")
    draft_device: Literal["gpu", "cpu"] = Field(description="where the draft ran")
    dtype: str = Field(description="the target's dtype as served")
    backend: str = Field(description="the target's backend as served (cupy+graphs, torch)")
    method: Literal["greedy"] = "greedy"
    k: int = Field(ge=1, le=64, description="draft tokens proposed per round")
    prompts: int = Field(ge=1, description="sequences, prompt ids drawn as serving draws them")
    prompt_tokens: int = Field(ge=1, description="tokens per prompt")
    rounds: int = Field(ge=1, description="speculative rounds per sequence")
    drafts: int = Field(ge=1, description="proposals in all (prompts x rounds)")
    reached: list[Annotated[int, Field(ge=0)]] = Field(
        description="[k] drafts whose positions before i were accepted (samples of rate i)")
    accepted: list[Annotated[int, Field(ge=0)]] = Field(
        description="[k] ... with position i accepted too")
    conditional_rates: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        description="[k] accepted[i] / reached[i]: P(i accepted | 0..i-1 accepted)")
    seconds: float | None = Field(default=None, ge=0, description="the measurement's wall time")
    sequences: list[str] | None = Field(
        default=None, description="[prompts] each sequence's agreement string, one character "
        "per generated position after the first: 1 the draft proposed the target's token, 0 "
        "it did not (a correction), ? never proposed (a bonus token); see the module")

    @model_validator(mode="after")
    def _counts_add_up(self):
        k = self.k
        for name in ("reached", "accepted", "conditional_rates"):
            if len(getattr(self, name)) != k:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries: expected "
                                 f"k = {k}, one per draft position")
        if self.drafts != self.prompts * self.rounds or self.reached[0] != self.drafts:
            raise ValueError(f"drafts ({self.drafts}) must equal prompts x rounds "
                             f"({self.prompts} x {self.rounds}) and reached[0] "
                             f"({self.reached[0]}): every draft reaches position 0")
        for i, (r, a) in enumerate(zip(self.reached, self.accepted)):
            if a > r:
                raise ValueError(f"accepted[{i}] = {a} exceeds reached[{i}] = {r}")
            if i + 1 < k and self.reached[i + 1] != a:
                raise ValueError(f"reached[{i + 1}] = {self.reached[i + 1]} must equal "
                                 f"accepted[{i}] = {a} (a draft reaches position {i + 1} "
                                 f"when position {i} is accepted)")
            rate = self.conditional_rates[i]
            if abs(rate - ratio(a, r)) > 10 ** -RATE_DIGITS:
                raise ValueError(f"conditional_rates[{i}] = {rate} but accepted[{i}] / "
                                 f"reached[{i}] = {a} / {r}")
        if self.sequences is not None:
            self._sequences_fit()
        return self

    def _sequences_fit(self) -> None:
        """ValueError unless `sequences` holds one string per prompt, each of `rounds` rounds
        at k, whose accepted lengths count into reached and accepted."""
        if len(self.sequences) != self.prompts:
            raise ValueError(f"sequences has {len(self.sequences)} strings: expected one per "
                             f"prompt ({self.prompts})")
        lengths = []
        for j, bits in enumerate(self.sequences):
            try:
                rounds = round_lengths(bits, self.k)
            except ValueError as err:
                raise ValueError(f"sequences[{j}]: {err}") from None
            if len(rounds) != self.rounds:
                raise ValueError(f"sequences[{j}] holds {len(rounds)} rounds: expected "
                                 f"rounds = {self.rounds}")
            lengths += rounds
        reached, accepted = count_positions(lengths, self.k)
        if (reached, accepted) != (self.reached, self.accepted):
            raise ValueError(f"sequences count reached {reached} and accepted {accepted}, "
                             f"but the block says {self.reached} and {self.accepted}")

    @classmethod
    def from_lengths(cls, lengths: list[int], k: int, **fields) -> MeasuredAcceptance:
        """The block of drafts that each proposed k tokens and kept the first `lengths[j]`."""
        reached, accepted = count_positions(lengths, k)
        return cls(k=k, drafts=len(lengths), reached=reached, accepted=accepted,
                   conditional_rates=[round(ratio(a, r), RATE_DIGITS)
                                      for a, r in zip(accepted, reached)], **fields)

    def unconditional_rates(self) -> list[float]:
        """[k] fraction of drafts with position i accepted (vLLM's per-position rates)."""
        return [a / self.drafts for a in self.accepted]

    def acceptance_length(self) -> float:
        """Tokens per round at this k: 1 + accepted / drafts."""
        return 1.0 + sum(self.accepted) / self.drafts

    def describe(self) -> str:
        return (f"measured on {self.device} ({self.dtype}, {self.backend}, draft "
                f"{self.draft_model} {self.draft_quant} on the {self.draft_device}): "
                f"{self.drafts} greedy drafts at k = {self.k}")


def count_positions(lengths: list[int], k: int) -> tuple[list[int], list[int]]:
    """([k] reached, [k] accepted) of drafts of k proposals that kept `lengths[j]` each."""
    return ([sum(n >= i for n in lengths) for i in range(k)],
            [sum(n > i for n in lengths) for i in range(k)])


def ratio(a: int, r: int) -> float:
    return a / r if r else 0.0


def agreement(lengths: list[int], k: int) -> str:
    """One sequence's agreement string from its rounds' accepted lengths, in order, each
    round of k proposals: n '1's, then '0' (n < k: the correction) or '?' (n = k: the
    bonus, never proposed)."""
    return "".join("1" * n + ("0" if n < k else UNKNOWN) for n in lengths)


def round_lengths(bits: str, k: int) -> list[int]:
    """The accepted lengths of the rounds at k that wrote agreement string `bits` (the
    inverse of agreement); ValueError, saying where, unless it is such rounds' string."""
    lengths, ones = [], 0
    for i, c in enumerate(bits):
        if c == "1" and ones < k:
            ones += 1
        elif (c == "0" and ones < k) or (c == UNKNOWN and ones == k):
            lengths.append(ones)
            ones = 0
        else:
            raise ValueError(f"character {i} is {c!r} after {ones} '1's: a round at k = {k} "
                             f"is up to {k - 1} '1's then '0', or {k} '1's then '?'")
    if ones:
        raise ValueError(f"it ends inside a round ({ones} '1's after the last '0' or '?')")
    return lengths


def combine(a: MeasuredAcceptance | None, b: MeasuredAcceptance | None
            ) -> MeasuredAcceptance | None:
    """The block of two profiles merged: the one there is, or both when they are the same
    measurement; None when neither has one. Two different ones raise ValueError."""
    if a is None or b is None or a == b:
        return a or b
    raise ValueError("both profiles hold an acceptance measurement, and they differ: keep "
                     "the one measured with the profile you merge into")


def calibrate_command(model: str, draft: str, quant: str, device: str = "gpu") -> str:
    """The command that measures a pair's acceptance into a profile."""
    return (f"kestrel calibrate --model {model} --draft {draft} --draft-quant {quant} "
            f"--draft-device {device} --out PROFILE.json")


def profile_for(from_profile: bool | str, costs_profile: str | None, hardware: str
                ) -> str | None:
    """The Profile file spec.acceptance.from_profile names: a path of its own, else the
    scenario's costs.profile, else its hardware when that is a Profile JSON; None if none."""
    if isinstance(from_profile, str):
        return from_profile
    if costs_profile is not None:
        return costs_profile
    return hardware if str(hardware).endswith(".json") else None


def check_pair(block: MeasuredAcceptance, path: str | Path, k: int, draft_quant: str,
               draft_device: str, command: str) -> None:
    """ValueError where a profile's measured acceptance is of another draft quant or draft
    device than the scenario's, or of fewer positions than its k."""
    if block.k < k:
        raise ValueError(f"profile {path} measured acceptance at k = {block.k}, fewer "
                         f"positions than the scenario's spec.k = {k}: lower spec.k, or "
                         f"measure with a grid whose largest verify k is at least {k} "
                         f"(`{command} --grid GRID`)")
    if block.draft_quant != draft_quant:
        raise ValueError(f"profile {path} measured the acceptance of draft "
                         f"{block.draft_model} quantized {block.draft_quant}, but the "
                         f"scenario's draft.quant is {draft_quant}: measure that pair "
                         f"(`{command}`)")
    if block.draft_device != draft_device:
        raise ValueError(f"profile {path} measured the acceptance with the draft on the "
                         f"{block.draft_device}, but the scenario's draft.device is "
                         f"{draft_device} (another dtype and backend, so other numbers): "
                         f"measure it there (`{command}`)")
