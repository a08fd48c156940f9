"""kestrel_sim: the shared language (scenario, trace, metrics, profile) and the SimPy model.

Never imports torch, cupy or kestrel_rt.
"""
