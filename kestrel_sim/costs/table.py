"""Fixed per-stage cost table (milliseconds), to replay a published breakdown.

A stage's value is a number (ms per step) or a mapping {batch size: ms}, interpolated
linearly in batch size and clamped at both ends. `prefill_per_token` adds ms per prompt
token to prefill steps. With service "exponential" each step's time is drawn from an
exponential distribution whose mean is the table value (queueing checks, M/M/1).

A mixed step (a decode or verify step carrying a prefill chunk of P tokens, colocated
`prefill_schedule: mixed`) costs the stage's value plus `prefill_per_token` x P, and at
least the chunk's own prefill step: the per-step values are read as the forward's fixed
cost (weights, launches), paid once. A table without `prefill_per_token` has no
per-token part to split off, so the chunk adds its whole `prefill` step (no saving).
With service exponential one draw scales the whole mixed step.

A table knows no bandwidth / compute split: each step uses the whole device (base.BUSY),
so steps that overlap on one device (serving.devices) share it in time.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from kestrel_sim.costs.base import BUSY, Chunk, Shares
from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import TableCosts


class TableCost:
    __slots__ = ("_per_token", "_rng", "_stages", "_zero")

    def __init__(
        self, table: TableCosts, rng: np.random.Generator | None = None,
        zero_stages: tuple[str, ...] = (),
    ):
        self._stages: dict[str, tuple[list[int], list[float]]] = {}
        for stage in ("prefill", "draft", "verify", "correction", "decode"):
            v = getattr(table, stage)
            if v is None:
                continue
            if isinstance(v, dict):
                items = sorted(v.items())
                self._stages[stage] = ([b for b, _ in items], [ms * 1e-3 for _, ms in items])
            else:
                self._stages[stage] = ([1], [v * 1e-3])
        self._per_token = (table.prefill_per_token or 0.0) * 1e-3
        if self._per_token and "prefill" not in self._stages:
            self._stages["prefill"] = ([1], [0.0])
        self._rng = rng if table.service == "exponential" else None
        self._zero = zero_stages
        if self._rng is None and table.service == "exponential":
            raise ConfigError("costs.table.service: exponential needs a random generator")

    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        if stage in self._zero:
            return 0.0
        t = self._mean(stage, batch, m)
        if self._rng is not None:
            t *= self._rng.exponential()
        return t

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float,
                      chunk: Chunk) -> float:
        t = self._mean(stage, batch, m)
        alone = self._mean("prefill", chunk.batch, chunk.m)  # the chunk as its own step
        t = max(t + self._per_token * chunk.tokens, alone) if self._per_token else t + alone
        if self._rng is not None:
            t *= self._rng.exponential()
        return t

    def shares(self, stage: str, batch: int, m: float, context: float,
               chunk: Chunk | None = None) -> Shares:
        return BUSY

    def _mean(self, stage: str, batch: int, m: float) -> float:
        try:
            xs, ys = self._stages[stage]
        except KeyError:
            raise ConfigError(
                f"costs.table has no entry for stage '{stage}', which this scenario needs"
            ) from None
        if len(xs) == 1 or batch <= xs[0]:
            t = ys[0]
        elif batch >= xs[-1]:
            t = ys[-1]
        else:
            i = bisect_right(xs, batch)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            t = y0 + (y1 - y0) * (batch - x0) / (x1 - x0)
        if stage == "prefill":
            t += self._per_token * batch * m
        return t
