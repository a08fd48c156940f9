"""A device that several workers run on (serving.devices places them there): the steps
that overlap in time slow each other (kestrel_sim/costs/contention.py).

Each step is a Job: its time alone (`seconds`, as the cost model priced it), its Shares of
the device and its side. The device keeps the active jobs and advances them as a
fluid: while the set is unchanged, job i runs at 1 / f_i of its speed alone (f from
contention.slowdowns over the whole set). When a job starts or ends, every job's progress
is brought up to now, the factors are computed again (Contention.slowdowns: its law), and one timeout is scheduled for
the first job to finish; an older timeout still pending finds the device re-planned (its
plan number passed) and does nothing. So a step costs one or two SimPy events, not one
per token or per change of rate, and a step that never overlaps ends exactly `seconds`
after it started (the same float as env.timeout(seconds)).

A job remembers when its rate changed (`marks`), so that the spans written for it at its
start, in times alone, are moved onto the times it really ran (`retime`).
"""

from __future__ import annotations

import simpy

from kestrel_sim.costs.base import Shares
from kestrel_sim.costs.contention import Contention


class Job:
    __slots__ = ("done", "factor", "grain", "left", "marks", "seconds", "shares", "side",
                 "start")

    def __init__(self, done: simpy.Event, seconds: float, shares: Shares, side: str,
                 start: float, grain: float | None = None):
        self.done = done  # succeeds when the job finishes
        self.seconds = seconds  # its time alone
        # the time alone of one of its steps (a round's k draft steps: one's), the time
        # the contention law weighs it by
        self.grain = seconds if grain is None else grain
        self.shares = shares
        self.side = side  # decode, prefill or draft (contention.py)
        self.start = start
        self.left = seconds  # time alone still to run
        self.factor = 1.0  # f: wall seconds per second alone, now
        self.marks: list[tuple[float, float, float]] = [(start, 0.0, 1.0)]  # (wall, done, f)

    def wall(self, offset: float) -> float:
        """When the job reached `offset` seconds of its time alone."""
        for wall, done, factor in reversed(self.marks):
            if offset >= done:
                return wall + (offset - done) * factor
        return self.start

    def retime(self, spans: list, end: float) -> None:
        """Move spans written in times alone (from self.start) onto the times it ran."""
        if len(self.marks) == 1 and self.factor == 1.0:
            return  # never overlapped: its times are those it ran
        t0 = self.start
        for s in spans:
            s.start = min(self.wall(s.start - t0), end)
            s.end = end if s.end - t0 >= self.seconds else min(self.wall(s.end - t0), end)


class SharedDevice:
    """One GPU shared by every worker of a scenario; see the module docstring."""

    __slots__ = ("contention", "env", "jobs", "last", "plan")

    def __init__(self, env: simpy.Environment, contention: Contention):
        self.env = env
        self.contention = contention
        self.jobs: list[Job] = []  # active, in start order
        self.last = 0.0  # when progress was last brought up to date
        self.plan = 0  # the current plan's number

    def run(self, seconds: float, shares: Shares, side: str, grain: float | None = None
            ) -> Job:
        """Start a step of `seconds` alone (its steps `grain` each, where several); yield its
        `done` event, then `retime` its spans."""
        env = self.env
        now = env.now
        self._advance(now)
        job = Job(env.event(), seconds, shares, side, now, grain)
        self.jobs.append(job)
        self._replan(now)
        return job

    def _advance(self, now: float) -> None:
        dt = now - self.last
        if dt > 0:
            for j in self.jobs:
                j.left -= dt / j.factor
        self.last = now

    def _replan(self, now: float) -> None:
        jobs = self.jobs
        factors = self.contention.slowdowns([j.grain for j in jobs], [j.shares for j in jobs],
                                            [j.side for j in jobs])
        first, wait = None, float("inf")
        for j, f in zip(jobs, factors):
            if f != j.factor:
                j.marks.append((now, j.seconds - j.left, f))
                j.factor = f
            t = max(j.left, 0.0) * f
            if t < wait:
                first, wait = j, t
        self.plan += 1
        plan = self.plan
        self.env.timeout(wait).callbacks.append(lambda _ev: self._finish(plan, first))

    def _finish(self, plan: int, job: Job) -> None:
        if plan != self.plan:
            return  # re-planned since: a later timeout finishes the first job
        now = self.env.now
        self._advance(now)
        job.left = 0.0
        done = [j for j in self.jobs if j.left <= 1e-9 * j.seconds]  # (rounding)
        self.jobs = [j for j in self.jobs if j.left > 1e-9 * j.seconds]
        if self.jobs:
            self._replan(now)
        for j in done:
            j.done.succeed()


def occupy(st, w, seconds: float, shares: Shares, side: str, spans: list,
           grain: float | None = None):
    """Run a step of `seconds` alone (steps of `grain` each, where several) on the worker's
    shared device (a SimPy generator: `yield from` it); its `spans`, written in times alone
    from now, go to the trace in the times it ran."""
    job = w.device.run(seconds, shares, side, grain)
    yield job.done
    job.retime(spans, st.env.now)
    st.spans.extend(spans)
