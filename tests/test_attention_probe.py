"""bench/probes/attention_probe.py's reading of the decode attention's probe records (the kernel's
DECODE_PROBE build writes them on the GPU; here synthetic ones)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))

from attention_probe import MARKS, WORDS, phases


def record(start_ns: int, marks_us: list[float], ghz: float = 2.0) -> list[int]:
    """One block's record: ids, smid, start, clock marks (cycles), then ns and cycles at save."""
    cycles = [int(m * 1e3 * ghz) if m >= 0 else -1 for m in marks_us]
    end_us = max(marks_us)
    return [0, 0, 0, start_ns] + cycles + [int(end_us * 1e3), int(end_us * 1e3 * ghz)]


def test_phases_are_the_differences_between_marks_and_merge_only_where_merged():
    rows = [record(0, [1.0, 2.5, 4.0, 5.0, 5.5, -1]),       # a block that does not merge
            record(200, [1.0, 2.5, 4.0, 5.0, 5.5, 7.5])]    # the merging block, 0.2 us later
    assert all(len(r) == WORDS for r in rows) and MARKS == 6
    got = phases(rows, per_launch=2)
    assert got["GHz"] == pytest.approx(2.0)
    assert got["wait"] == pytest.approx(1.0) and got["rope"] == pytest.approx(1.5)
    assert got["keys"] == pytest.approx(1.5) and got["partials"] == pytest.approx(1.0)
    assert got["ticket"] == pytest.approx(0.5) and got["merge"] == pytest.approx(2.0)
    assert got["span"] == pytest.approx(7.7)  # first start to the last block's save


def test_spans_are_per_launch():
    rows = [record(0, [1, 2, 3, 4, 5, -1]), record(100_000, [1, 2, 3, 4, 5, 9])]
    assert phases(rows, per_launch=1)["span"] == pytest.approx((5 + 9) / 2)
