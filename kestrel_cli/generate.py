"""`kestrel generate` (placeholder until the runtime lands)."""

from __future__ import annotations


def generate() -> None:
    """Generate tokens with the runtime."""
    raise NotImplementedError("kestrel generate: the runtime is not built yet")
