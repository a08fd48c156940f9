"""Measured points into kestrel_sim's Profile (schema 2): the one place that knows it.

    profile = to_profile(records, fingerprint)   # validated; Profile.save writes it atomically

`records` are calibration/measure.py's Records; `fingerprint` the Fingerprint's fields
(calibration/driver.py `fingerprint`). Each Measurement carries the stage, the step's shape
(batch, tokens per sequence, context; a mixed step's one prompt chunk; a transfer's bytes
and device pair), the device it ran on ("gpu" or "cpu") and the median time with its p10 /
p90. The Profile's `runtime` (how its prompt chunks run and the batch buckets of its step
graphs, if any) is read from the fingerprint's options, so every part of one plan,
measured apart, says the same.
"""

from __future__ import annotations

from calibration.overlap_grid import overlap_measurement
from kestrel_sim.profile import Fingerprint, Measurement, Profile
from kestrel_sim.runtime_info import RuntimeInfo


def to_measurement(rec) -> Measurement:
    """A Record as a Measurement (kestrel_sim/profile.py says how each stage reads)."""
    p = rec.point
    if p.stage == "overlap":  # the two workers' steps at once: calibration/overlap_grid.py
        return overlap_measurement(rec)
    mixed = p.stage == "mixed"
    return Measurement(
        stage=p.stage,
        batch=p.batch,
        tokens_per_seq=p.m,
        context=p.context,
        chunk_batch=1 if mixed else None,  # one prompt's chunk rides along
        chunk_tokens=p.chunk_tokens if mixed else None,
        chunk_context=p.chunk_context if mixed else None,
        bytes=rec.bytes,
        link=rec.link,
        device=p.device,
        ms=rec.ms,
        samples=rec.samples,
        p10=rec.p10,
        p90=rec.p90,
    )


def runtime_info(fingerprint: dict) -> RuntimeInfo:
    """How the measuring runtime runs its steps, from a fingerprint's options (per bench:
    calibration/driver.py `fingerprint`): its prompt chunks one forward per chunk
    (kestrel_rt/serve/forward.py prefill_forward, and measure.py), with graphs or without;
    where a bench runs CUDA graphs (the GPU benches of a GPU with the graphs option on, all
    alike), the batch buckets and largest M of the step graphs (kestrel_rt/cuda/graphs.py)
    and, for a dense target, the prefill graphs' lengths; without graphs (the CPU, or
    graphs off) no buckets: each step runs at its own batch."""
    options = fingerprint.get("options") or {}
    if not any(bench.get("graphs") for bench in options.values()):
        return RuntimeInfo(chunks="per_chunk")
    from kestrel_rt.cuda.graphs import BUCKETS, MAX_M, PREFILL_BUCKETS

    # a MoE model's prefill runs eagerly (CupyBackend.graph_safe): no prefill graphs
    moe = _is_moe(fingerprint.get("model"))
    return RuntimeInfo(batch_buckets=list(BUCKETS), max_m=MAX_M,
                       prefill_buckets=None if moe else list(PREFILL_BUCKETS),
                       chunks="per_chunk")  # serving and measure.py: a forward per chunk


def _is_moe(model: str | None) -> bool:
    from kestrel_sim.costs.shape import model_shape
    from kestrel_sim.errors import KestrelError

    try:
        return bool(model) and model_shape(model).is_moe
    except (KestrelError, KeyError, OSError):
        return False


def to_profile(records, fingerprint: dict, acceptance=None) -> Profile:
    """The Profile of a calibration: its fingerprint, its runtime (runtime_info), one
    Measurement per record and the pair's measured acceptance, if any
    (calibration/acceptance.py)."""
    return Profile(fingerprint=Fingerprint(**fingerprint), runtime=runtime_info(fingerprint),
                   measurements=[to_measurement(r) for r in records], acceptance=acceptance)
