"""The checks a calibration grid's lists of values share (calibration/grid.py, overlap_grid.py
and round_grid.py): sizes sorted with repeats dropped, and k within the CUDA-graphed shapes."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

MAX_K = 15  # verify M = k + 1 <= 16: the CUDA-graphed shapes (GraphModel.max_m)


def sorted_at_least(values: list[int], what: str, low: int) -> list[int]:
    """values sorted, repeats dropped; ValueError where empty or one is below `low`."""
    if not values:
        raise ValueError(f"needs at least one {what}")
    bad = [v for v in values if v < low]
    if bad:
        raise ValueError(f"every {what} must be >= {low} (got {bad[0]})")
    return sorted(set(values))


def at_most_max_k(ks: list[int]) -> list[int]:
    """Sorted k values, the largest at most MAX_K (else ValueError)."""
    if ks[-1] > MAX_K:
        raise ValueError(f"k must be at most {MAX_K} (M = k + 1 <= 16, the CUDA-graphed "
                         f"verify shapes; got {ks[-1]})")
    return ks


def sizes(what: str, zero: bool = False):
    """A list of sizes (>= 1, or >= 0 with zero), at least one, sorted, repeats dropped."""
    low = 0 if zero else 1
    return Annotated[list[int], AfterValidator(lambda v: sorted_at_least(v, what, low))]


Batches = sizes("batch")
Contexts = sizes("context", zero=True)
NewTokens = sizes("new token count")
Ks = sizes("k")
KsOrZero = sizes("k", zero=True)
Lengths = sizes("length")
