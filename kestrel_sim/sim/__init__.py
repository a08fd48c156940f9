"""The SimPy model: workers, queues, speculative rounds, KV capacity and transfer links."""

from kestrel_sim.sim.engine import simulate

__all__ = ["simulate"]
