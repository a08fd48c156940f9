"""The speculative decoder's settings: one validated object, given at construction."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kestrel_rt.sampling import SEED_RANGE
from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import Acceptance


class SpecConfig(BaseModel):
    """k draft tokens per round; `fused` takes the correction / bonus token from the verify
    logits, `separate` runs an extra one-token target forward for it every round.
    temperature 0 is greedy; above 0, lossless rejection sampling with top_p on both models.
    Request i samples with generators seeded from (seed, i) (random when seed is None).
    `acceptance` (alpha, per_position or trace, as a scenario's spec.acceptance) switches on
    controlled acceptance: all the real work, but the number accepted is drawn from it."""

    model_config = ConfigDict(extra="forbid")

    k: int = Field(4, ge=1, le=16)
    correction: Literal["fused", "separate"] = "fused"
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=SEED_RANGE)
    acceptance: Acceptance | None = None

    @model_validator(mode="after")
    def _enough_rates(self):
        rates = self.acceptance.per_position if self.acceptance else None
        if rates is not None and len(rates) < self.k:
            raise ValueError(f"acceptance.per_position has {len(rates)} rates: expected at "
                             f"least k = {self.k} (one per draft position)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def controlled(self) -> bool:
        return self.acceptance is not None

    @classmethod
    def parse(cls, **options) -> SpecConfig:
        """SpecConfig(**options), a bad value raised as a ConfigError naming the key."""
        try:
            return cls(**options)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}"
                                 for e in err.errors())
            raise ConfigError(f"speculative decoding settings are not valid: {problems}") from None
