"""Workload: arrival times and prompt/output lengths, all drawn up front from one Generator.

Draw order (fixed, so a seed reproduces a run): arrivals, prompt lengths, output lengths.
A closed loop has no arrival times up front: its clients send the next request when the
previous one finishes (the simulator does that); `arrivals` is then None.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_sim.datafiles import read_counts, read_replay
from kestrel_sim.errors import ConfigError
from kestrel_sim.workload_spec import (
    ClosedLoopArrivals,
    EmpiricalDist,
    FixedDist,
    GammaArrivals,
    LognormalDist,
    NormalDist,
    PoissonArrivals,
    ReplayArrivals,
    UniformDist,
    Workload,
)

DEFAULT_REQUESTS = 1000


@dataclass
class DrawnWorkload:
    arrivals: np.ndarray | None  # [n] seconds, nondecreasing; None for a closed loop
    prompt: np.ndarray  # [n] int64 >= 1
    output: np.ndarray  # [n] int64 >= 1
    concurrency: int = 0  # closed loop only
    think_time_s: float = 0.0  # closed loop only

    @property
    def n(self) -> int:
        return len(self.prompt)


def _lengths(d, n: int, rng: np.random.Generator, where: str) -> np.ndarray:
    if isinstance(d, FixedDist):
        return np.full(n, d.value, dtype=np.int64)
    if isinstance(d, UniformDist):
        return rng.integers(d.low, d.high + 1, size=n, dtype=np.int64)
    if isinstance(d, NormalDist | LognormalDist):
        if isinstance(d, NormalDist):
            x = rng.normal(d.mean, d.std, size=n)
        else:
            sigma2 = np.log1p((d.std / d.mean) ** 2)
            x = rng.lognormal(np.log(d.mean) - sigma2 / 2, np.sqrt(sigma2), size=n)
        x = np.rint(x)
        return np.clip(x, d.min, d.max if d.max is not None else None).astype(np.int64)
    if isinstance(d, EmpiricalDist):
        values = read_counts(d.file, f"{where} empirical distribution", low=1)
        return rng.choice(values, size=n, replace=True)
    raise TypeError(d)  # unreachable: the schema admits only the above


def draw_workload(w: Workload, rng: np.random.Generator,
                  context: int | None = None) -> DrawnWorkload:
    """Draw every request. `context` (the model's context length): a drawn request whose
    prompt + output exceed it is an error (validation already refuses bounded lengths
    that can; this catches the tail of a normal or lognormal without `max`)."""
    a = w.arrivals
    replay = read_replay(a.file) if isinstance(a, ReplayArrivals) else None
    if replay is not None:
        rows = len(replay["arrival"])
        if w.requests is not None and w.requests > rows:
            raise ConfigError(
                f"workload.requests is {w.requests} but the arrival trace {a.file} has only "
                f"{rows} rows: lower workload.requests or leave it out"
            )
        n = w.requests or rows
    else:
        n = w.requests or DEFAULT_REQUESTS

    arrivals = None
    closed = (0, 0.0)
    if isinstance(a, PoissonArrivals):
        arrivals = np.cumsum(rng.exponential(1.0 / a.rate, size=n))
    elif isinstance(a, GammaArrivals):
        shape = 1.0 / a.cv**2
        arrivals = np.cumsum(rng.gamma(shape, 1.0 / (a.rate * shape), size=n))
    elif isinstance(a, ClosedLoopArrivals):
        closed = (a.concurrency, a.think_time_s)
    else:
        scale = 1e-3 if a.time_unit == "ms" else 1.0
        order = np.argsort(replay["arrival"], kind="stable")[:n]  # the first n in time
        t = replay["arrival"][order] * scale
        arrivals = (t - t[0]) / a.speedup
        replay = {k: v[order] for k, v in replay.items()}

    prompt = _lengths(w.prompt_tokens, n, rng, "workload.prompt_tokens")
    output = _lengths(w.output_tokens, n, rng, "workload.output_tokens")
    if replay is not None:
        for key, arr in (("prompt_tokens", prompt), ("output_tokens", output)):
            if key in replay:  # whole numbers >= 1 (read_replay checks)
                arr[:] = replay[key]
    if context is not None:
        over = prompt + output > context
        if over.any():
            i = int(np.argmax(over))
            raise ConfigError(
                f"workload: request {i} drew a {prompt[i]}-token prompt and {output[i]} output "
                f"tokens, more than the model's context of {context} tokens: give "
                "workload.prompt_tokens / output_tokens a max")
    return DrawnWorkload(arrivals, prompt, output, *closed)
