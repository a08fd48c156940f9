"""`kestrel run` and `kestrel sweep` (placeholder until the simulator lands)."""

from __future__ import annotations


def run() -> None:
    """Run a scenario on the simulator."""
    raise NotImplementedError("kestrel run: the simulator is not built yet")


def sweep() -> None:
    """Run a grid of scenarios on the simulator."""
    raise NotImplementedError("kestrel sweep: the simulator is not built yet")
