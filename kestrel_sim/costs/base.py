"""The StageCost interface.

A step runs one stage over `batch` sequences x `m` new tokens at `context` cached tokens
each. A *mixed* step (colocated `prefill_schedule: mixed`, as vLLM's chunked prefill)
is one target forward that carries a decode or verify step plus a prefill `Chunk`;
`mixed_seconds` prices it. Each implementation documents its rule; all keep
    max(step alone, chunk alone) <= mixed_seconds <= step alone + chunk alone
(one forward does at least the work of either part, and never costs more than the two
run apart).

`shares` says how a step uses its device, for steps of several workers that overlap on one
GPU (kestrel_sim/costs/contention.py): the fractions of its time it is bound by memory
bandwidth and by compute, and the fractions of the device's bandwidth and compute it uses
on average, all from the same terms that price it (no random draw).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

STAGES = ("prefill", "draft", "verify", "correction", "decode")


class Chunk(NamedTuple):
    """The prefill part of a mixed step: `batch` prompts x `m` tokens (mean) each, at
    `context` tokens (mean) already prefilled per prompt."""

    batch: int
    m: float
    context: float

    @property
    def tokens(self) -> float:
        return self.batch * self.m


class Shares(NamedTuple):
    """How one step uses its device, as fractions of the step's own time (alone):

    bandwidth      the device's memory bandwidth it uses, on average (bytes moved over
                   bandwidth, divided by its time)
    compute        the device's compute it uses, on average (flops over peak rate)
    memory_bound   the part of its time the bandwidth limits (bytes are the binding term)
    compute_bound  the part of its time compute limits

    memory_bound + compute_bound <= 1: the rest is overhead (launches, host work, gaps)
    that another stream's kernels can fill. bandwidth >= memory_bound and compute >=
    compute_bound (a memory-bound phase still computes, and the other way round)."""

    bandwidth: float
    compute: float
    memory_bound: float
    compute_bound: float

    @property
    def busy(self) -> float:
        return self.memory_bound + self.compute_bound


IDLE = Shares(0.0, 0.0, 0.0, 0.0)  # a step that does not use the device (a CPU draft's)
BUSY = Shares(1.0, 1.0, 0.5, 0.5)  # no bandwidth / compute split known: the whole device


def shares_of(bytes_s: float, flops_s: float, memory_s: float, compute_s: float,
              total_s: float) -> Shares:
    """Shares from seconds: of bytes moved at full bandwidth, of flops at full rate, of
    time bound by each, over the step's `total_s` (each fraction kept within 0..1)."""
    if total_s <= 0:
        return IDLE
    inv = 1.0 / total_s
    memory = min(1.0, memory_s * inv)
    return Shares(min(1.0, bytes_s * inv), min(1.0, flops_s * inv), memory,
                  max(0.0, min(compute_s * inv, 1.0 - memory)))


def blend(parts) -> Shares:
    """The Shares of several parts run one after the other: [(seconds, Shares)], each
    fraction weighted by its part's seconds."""
    total = bw = fl = mem = comp = 0.0
    for seconds, sh in parts:
        total += seconds
        bw += seconds * sh.bandwidth
        fl += seconds * sh.compute
        mem += seconds * sh.memory_bound
        comp += seconds * sh.compute_bound
    return shares_of(bw, fl, mem, comp, total)


class StageCost(Protocol):
    def seconds(self, stage: str, batch: int, m: float, context: float) -> float:
        """Time of one step of `batch` sequences x `m` new tokens at `context` cached tokens."""
        ...

    def mixed_seconds(self, stage: str, batch: int, m: float, context: float,
                      chunk: Chunk) -> float:
        """Time of one forward carrying a `stage` step (decode or verify) and `chunk`."""
        ...

    def shares(self, stage: str, batch: int, m: float, context: float,
               chunk: Chunk | None = None) -> Shares:
        """How the step (with `chunk`: the mixed forward) uses its device; see Shares."""
        ...
