"""Whether the cp.async ring gemv streams well on this GPU: a load-time measurement.

The ring kernel (kernels/gemv_ring.cu) is the default bf16 decode gemv below sm_90, but how
fast it streams depends on the machine: on one H200 it matched the tuned kernels, on another
of the same kind it streamed far slower (docs/performance.md). So a backend that asks for it
measures it once, on a product of the size of a 4096 x 4096 layer, against the tuned kernel,
and keeps it only where it is within `margin` of the tuned time.
"""

from __future__ import annotations

import torch

from kestrel_rt.cuda.gemv_plan import Plan, tuned_variant
from kestrel_rt.cuda.gemv_variants import RING_DEFAULT
from kestrel_rt.cuda.timing import time_graph


def probe_ring(gemv, n: int = 4096, k: int = 4096, copies: int = 8, reps: int = 5
               ) -> tuple[float, float]:
    """Device microseconds of one [1, k] x [n, k] bf16 product through the ring kernel and
    through the tuned kernel: `copies` products on distinct weights (more bytes than the L2
    holds: 256 MB while it runs; their contents do not matter) captured in a CUDA graph,
    median of `reps` replays."""
    dev = torch.device("cuda", gemv.device_index)
    ws = [torch.empty(n, k, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
    x = torch.zeros(1, k, dtype=torch.bfloat16, device=dev)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    tuned = Plan("tuned", tuned_variant("bf16", 1, n, k, gemv.sms, gemv.tuned))
    times = []
    with torch.cuda.device(dev):
        for chosen in (Plan("ring", RING_DEFAULT), tuned):
            def products(chosen=chosen) -> None:
                for w in ws:
                    gemv.matmul(x, w, out=out, chosen=chosen)

            times.append(time_graph(products, reps) * 1e6 / copies)
    return times[0], times[1]


def ring_streams_well(gemv, margin: float = 1.10) -> bool:
    """True when the ring kernel's probe time is within `margin` of the tuned kernel's; also
    True when the probe's 256 MB do not fit (nothing measured: the ring stays)."""
    try:
        ring_us, tuned_us = probe_ring(gemv)
    except torch.OutOfMemoryError:
        return True
    return ring_us <= margin * tuned_us
