"""The fit report's line for mixed rows priced without their fit: the error of what the
simulator does then (ProfileCost without a mixed fit), per device: a step and its prompt
chunks one forward each where the runtime runs them so (RuntimeInfo.chunks "per_chunk"),
else the step plus the chunk's marginal cost on the prefill fit."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_sim.costs.base import Chunk
from kestrel_sim.costs.profile import ProfileCost
from kestrel_sim.costs.report import fit_report
from kestrel_sim.costs.roofline import RooflineCost
from kestrel_sim.hardware import load_hardware
from kestrel_sim.models import preset
from kestrel_sim.profile import Profile

H200 = load_hardware("h200")
HOST_MS = 3.0  # per forward of a prompt chunk
BUCKETS = [1, 2, 4, 8, 16, 32, 64]


def profile(chunks: str | None, device: str = "gpu") -> Profile:
    """qwen3-8b timed by the H200 roofline, a host time per prompt chunk's forward; mixed
    rows measured as the runtime runs them: the verify's forward, then the chunk's."""
    cost = RooflineCost(H200, preset("qwen3-8b"))

    def ms(stage, b, m, c):
        return cost.seconds(stage, b, m, c) * 1e3

    rows = [{"stage": st, "batch": b, "tokens_per_seq": m, "context": c, "ms": ms(st, b, m, c)}
            for st, m in (("decode", 1), ("verify", 5)) for b in BUCKETS for c in (256, 4096)]
    rows += [{"stage": "prefill", "batch": b, "tokens_per_seq": n, "context": 0,
              "ms": b * (ms("prefill", 1, n, 0) + HOST_MS)} for b in (1, 2, 4) for n in (512, 2048)]
    rows += [{"stage": "mixed", "batch": b, "tokens_per_seq": m, "context": 512,
              "chunk_batch": 1, "chunk_tokens": n, "chunk_context": 0,
              "ms": ms("decode" if m == 1 else "verify", b, m, 512) + ms("prefill", 1, n, 0)
              + HOST_MS} for b in (4, 32) for m in (1, 5) for n in (512, 2048)]
    runtime = None
    if chunks is not None:
        runtime = {"batch_buckets": BUCKETS if device == "gpu" else [], "chunks": chunks}
    return Profile.model_validate({
        "fingerprint": {"device": "NVIDIA H200", "model": "qwen3-8b"}, "runtime": runtime,
        "measurements": [{**r, "device": device} for r in rows]})


def simulated_errors(p: Profile, device: str = "gpu") -> list[float]:
    """|error| % of each mixed row as the simulator prices it from the same profile without
    its mixed rows."""
    bare = p.model_copy(update={"measurements": [mm for mm in p.measurements
                                                 if mm.stage != "mixed"]})
    cost = ProfileCost(bare, device=device)
    assert not cost.has("mixed")
    return [abs(cost.mixed_seconds("decode" if mm.tokens_per_seq == 1 else "verify", mm.batch,
                                   mm.tokens_per_seq, mm.context, Chunk(*mm.chunk))
                * 1e3 / mm.ms - 1) * 100 for mm in p.rows("mixed", device)]


def line(p: Profile, name: str):
    got = [s for s in fit_report(p).stages if s.stage.startswith("mixed (")]
    assert [s.stage for s in got] == [name]
    return got[0]


def test_a_per_chunk_runtimes_line_is_the_simulators_step_then_chunks():
    p = profile("per_chunk")
    got = line(p, "mixed (step + chunks)")
    errs = simulated_errors(p)
    assert got.rows == got.held_out == len(errs) == 8
    assert got.corrected_median_pct == pytest.approx(float(np.median(errs)))
    assert got.corrected_max_pct == pytest.approx(max(errs))
    # the rows are the step's forward then the chunk's: priced so, they are met closely
    assert got.corrected_max_pct < 2.0
    # the marginal rule (one overhead, one weight read) misses the chunk's own forward
    old = line(profile(None), "mixed (marginal rule)")
    assert old.corrected_median_pct > 3 * got.corrected_median_pct + 1.0


def test_a_batched_runtimes_line_is_the_marginal_rule_the_simulator_uses():
    for p in (profile(None), profile("batched")):
        got = line(p, "mixed (marginal rule)")
        errs = simulated_errors(p)
        assert got.corrected_median_pct == pytest.approx(float(np.median(errs)))
        assert got.corrected_max_pct == pytest.approx(max(errs))


def test_a_cpu_profiles_mixed_rows_get_their_line():
    p = profile("per_chunk", device="cpu")
    got = line(p, "mixed (step + chunks)")
    assert got.device == "cpu" and got.held_out == 8
    assert got.corrected_median_pct == pytest.approx(float(np.median(simulated_errors(p, "cpu"))))
    assert "mixed (step + chunks) cpu" in fit_report(p).table()
