"""What the Trace of a simulated run keeps: every span and request ("full"), nothing
("none"), or a bounded sample ("sample", the default).

A sample cuts time into WINDOW_S windows and keeps everything that starts in a kept window:
the spans that start in it, and the requests that arrive in it (each with all of its
emissions, also after the window). At first every window is kept, so a run of up to
SAMPLE_SPANS spans keeps them all; whenever more are kept, every other kept window is
dropped (windows every 2, 4, 8, ... WINDOW_S), so a run of any length keeps at most
SAMPLE_SPANS spans, evenly spread over it. Metrics and time series never come from the
Trace (the Recorder sees every event), so they are the same whatever is kept.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from kestrel_sim.errors import ConfigError
from kestrel_sim.recorder import Recorder
from kestrel_sim.trace import RequestRecord, Span

TraceMode = Literal["full", "sample", "none"]
SAMPLE_SPANS = 100_000
WINDOW_S = 1.0


class TraceKeeper:
    """Fed the spans and emissions the Recorder is fed; gives the Trace's spans, requests
    and meta["trace"]."""

    def __init__(self, mode: str, budget: int | None = None, window_s: float | None = None):
        if mode not in ("full", "sample", "none"):
            raise ConfigError(f"trace '{mode}': expected full, sample or none")
        self.mode = mode
        self.budget = SAMPLE_SPANS if budget is None else budget
        self.window = WINDOW_S if window_s is None else window_s
        self.every = 1  # kept windows: those whose number is a multiple of this
        self.spans: list[Span] = []
        self.logged: list[tuple[np.ndarray, ...]] = []  # emissions kept: [m] index, time,
        # tokens, and the request's arrival
        self.seen = 0

    def _kept(self, t: np.ndarray | float):
        return (np.floor_divide(t, self.window) % self.every) == 0

    def add_spans(self, spans: list[Span]) -> None:
        self.seen += len(spans)
        if self.mode == "full" or (self.mode == "sample" and self.every == 1):
            self.spans.extend(spans)
            while len(self.spans) > self.budget and self.mode == "sample":
                self._halve()
        elif self.mode == "sample":
            window, every = self.window, self.every
            self.spans.extend(s for s in spans if (s.start // window) % every == 0)
            while len(self.spans) > self.budget:
                self._halve()

    def _halve(self) -> None:
        """Keep every other kept window."""
        self.every *= 2
        window, every = self.window, self.every
        self.spans = [s for s in self.spans if (s.start // window) % every == 0]
        logged = []
        for chunk in self.logged:
            keep = self._kept(chunk[3])  # by the request's arrival
            logged.append(tuple(a[keep] for a in chunk))
        self.logged = logged

    def add_emissions(self, index: np.ndarray, times: np.ndarray, counts: np.ndarray,
                      arrival: np.ndarray) -> None:
        """Emissions ([m] each) of requests arriving at `arrival` ([m])."""
        if self.mode == "none":
            return
        if self.mode == "sample" and self.every > 1:
            keep = self._kept(arrival)
            index, times, counts, arrival = index[keep], times[keep], counts[keep], arrival[keep]
        self.logged.append((index, times, counts, arrival))

    def meta(self) -> dict:
        """What was kept, for trace.meta["trace"]."""
        complete = self.mode == "full" or (self.mode == "sample" and self.every == 1)
        return {"mode": self.mode, "complete": complete, "spans_seen": self.seen,
                "spans_kept": len(self.spans), "sample_budget_spans": self.budget,
                "window_s": self.window, "windows_every_s": self.window * self.every}

    def requests(self, rec: Recorder) -> list[RequestRecord]:
        """Records of the kept requests, emissions included, from the Recorder's scalars."""
        if self.mode == "none":
            return []
        n = rec.count
        arrival = rec.view("arrival")
        kept = np.flatnonzero(self._kept(arrival)) if self.mode == "sample" else np.arange(n)
        if self.logged:
            index = np.concatenate([c[0] for c in self.logged])
            order = np.argsort(index, kind="stable")  # time order within a request
            index = index[order]
            times = np.concatenate([c[1] for c in self.logged])[order].tolist()
            counts = np.concatenate([c[2] for c in self.logged])[order].tolist()
            bounds = np.searchsorted(index, np.arange(n + 1)).tolist()
        else:
            times, counts, bounds = [], [], [0] * (n + 1)

        def opt(name: str) -> list[float | None]:
            values = rec.view(name)[kept]
            return [None if math.isnan(v) else v for v in values.tolist()]

        prefill, decode, finish = opt("prefill_start"), opt("decode_start"), opt("finish_time")
        prompt = rec.view("prompt")[kept].tolist()
        output = rec.view("output")[kept].tolist()
        preempted = rec.view("preemptions")[kept].tolist()
        records = []
        for j, i in enumerate(kept.tolist()):
            lo, hi = bounds[i], bounds[i + 1]
            records.append(RequestRecord(
                id=i, arrival=float(arrival[i]), prompt_tokens=prompt[j], output_tokens=output[j],
                prefill_start=prefill[j], decode_start=decode[j], finish=finish[j],
                emit_times=times[lo:hi], emit_counts=counts[lo:hi], preemptions=preempted[j]))
        return records
