"""bench/measure.py's frontier: what each kernel adds to a timeline of overlapping kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from measure import frontier


def test_serial_kernels_share_their_durations_and_gaps_are_idle():
    shares, idle = frontier([("a", 0.0, 2.0), ("b", 3.0, 4.0), ("a", 4.5, 6.0)])
    assert shares == {"a": 3.5, "b": 1.0} and idle == 1.5


def test_an_early_launched_kernel_costs_only_what_it_adds():
    """PDL: b starts (and waits) while a runs; it costs the step only its end past a's."""
    shares, idle = frontier([("b", 1.0, 7.0), ("a", 0.0, 5.0), ("c", 2.0, 6.0)])
    assert shares == {"a": 5.0, "b": 2.0, "c": 0.0} and idle == 0.0
    assert sum(shares.values()) + idle == 7.0  # the span, first start to last end


def test_empty():
    assert frontier([]) == ({}, 0.0)
