"""Each request's accepted lengths in a simulated run, for the acceptance tests."""

from __future__ import annotations


def per_request(run) -> dict[int, list[int]]:
    """Each request's kept accepted lengths, round by round, from the verify spans."""
    out: dict[int, list[int]] = {}
    for s in sorted((s for s in run.spans if s.kind == "verify"), key=lambda s: s.start):
        for rid, n in zip(s.requests, s.accepted):
            out.setdefault(rid, []).append(n)
    return out
