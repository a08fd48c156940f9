"""kestrel_rt/cuda/precompile.py: the module list, and a failing job is reported, not raised."""

from __future__ import annotations

from kernels import KERNEL_DIR
from kestrel_rt.cuda import precompile
from kestrel_rt.cuda.gemv_variants import (
    BULK_ARGMAX_PROS,
    BULK_RSTD_PROS,
    KERNELS,
    RING_PROS,
    SWIGLU,
    module_pros,
    pros_of,
)


def test_jobs_cover_every_kernel_file_once_per_options():
    jobs = precompile.jobs()
    assert len(jobs) == len(set(jobs))
    whole = {j[1] for j in jobs if j[0] == "kernels"}
    gemv = {j[1] for j in jobs if j[0] == "gemv"}
    persistent = {j[1] for j in jobs if j[0] == "persistent"}
    assert whole | gemv | persistent == {p.stem for p in KERNEL_DIR.glob("*.cu")}
    assert gemv == set(KERNELS) and not whole & gemv and not persistent & (whole | gemv)
    assert persistent == set(precompile.PERSISTENT)
    for source in precompile.PERSISTENT:  # every prologue a ring or bulk kernel takes
        extra = BULK_RSTD_PROS + BULK_ARGMAX_PROS if source == "gemv_bulk" else ()
        assert ({j[2] for j in jobs if j[:2] == ("persistent", source)}
                == set(RING_PROS + extra))
    for file in KERNELS:  # every prologue / epilogue the runtime asks for (+ the experts')
        assert {j[2] for j in jobs if j[:2] == ("gemv", file)} == set(module_pros(file))
        assert set(module_pros(file)) == set(pros_of(file)) | {SWIGLU}
    assert set(pros_of("gemv")) > set(pros_of("gemv_int4"))


def test_sweep_adds_the_every_variant_modules_first():
    plain, sweep = precompile.jobs(), precompile.jobs(sweep=True)
    extra = [j for j in sweep if j not in plain]
    assert sweep[len(extra):] == plain  # the largest modules are started first
    assert set(extra) == {("gemv-sweep", f, pro) for f in KERNELS
                          for pro in precompile.SWEEP_PROS}


def test_a_failing_job_returns_its_error():
    job, seconds, error = precompile.compile_job(("kernels", "no_such_file"))
    assert job == ("kernels", "no_such_file") and seconds >= 0
    assert error  # no CUDA here, or no such file on a GPU machine: reported either way
