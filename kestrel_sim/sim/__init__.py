"""The SimPy model: workers, queues, speculative rounds, KV capacity and transfer links."""

from kestrel_sim.sim.engine import SimRun, simulate

__all__ = ["SimRun", "simulate"]
