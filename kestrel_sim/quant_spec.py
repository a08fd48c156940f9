"""The quantization modes a scenario, the runtime and the cost models name: none, int8, int4,
and int4-last-N (the projections of the last N layers in int4, the others in int8)."""

from __future__ import annotations

import re

MIXED = re.compile(r"int4-last-(\d+)")


def int4_last(quant: str | None) -> int | None:
    """N of an int4-last-N mode, else None."""
    mixed = MIXED.fullmatch(str(quant))
    return None if mixed is None else int(mixed.group(1))


def check_quant(value: str) -> str:
    """none, int8, int4 or int4-last-N: the runtime's quantization modes."""
    if value in ("none", "int8", "int4") or int4_last(value) is not None:
        return value
    raise ValueError(f"'{value}' is not a quantization: expected none, int8, int4 or "
                     "int4-last-N (int4 in the last N layers, int8 in the others)")
