"""kestrel_sim: the shared language (scenario, trace, metrics, profile) and the SimPy model.

Never imports torch, cupy or kestrel_rt.
"""

__all__ = ["simulate"]


def __getattr__(name: str):
    # Lazy, so importing a schema module (kestrel_sim.trace) does not load SimPy.
    if name == "simulate":
        from kestrel_sim.sim.engine import simulate

        return simulate
    raise AttributeError(f"module 'kestrel_sim' has no attribute {name!r}")
