"""Serving on the runtime: the simulator's stages and queues, run for real and traced.

    from kestrel_rt.serve import serve
    served = serve(scenario, "cuda")      # a kestrel_sim Trace, source "hardware"

The loop (worker.py, one screen): schedule (scheduler.py: admission from the prefill or
decode queue, a round or a prefill step by the simulator's rules), run (forward.py: all
model execution, timed as spans), postprocess (postprocess.py: emit, finish, join the
batch or hand the KV over). engine.py holds the shared state and drives the workers;
requests.py / arrivals.py the workload; queues.py, kv.py the queues and the KV budget and
slots; handover.py the disaggregated KV copy; speculate.py the scenario's speculative
decoding (kestrel_rt/spec's decoder on a worker); settings.py the scenario's serving keys;
models.py builds model instances (kestrel_rt/runner.py); build.py puts it together.
"""

from kestrel_rt.serve.build import Served, serve

__all__ = ["Served", "serve"]
