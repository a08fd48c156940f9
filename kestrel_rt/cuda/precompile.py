"""Compile every kernel module once, in parallel processes, to fill cupy's on-disk cache.

    python -m kestrel_rt.cuda.precompile [--workers N] [--sweep]

cupy keys its kernel cache (~/.cupy/kernel_cache, or CUPY_CACHE_DIR) by source, options and
architecture, so a module compiled here is loaded, not compiled, by every later process
that asks for it with the same options: the GPU tests' xdist workers (tests/conftest.py
calls `precompile(sweep=True)` before they start: else each of them compiles the same ~35 modules
with NVRTC at once), a benchmark, a server's first request. Each job runs in a fresh
("spawn") process; a job that fails is reported, not raised: the process that needs the
module compiles it itself and shows the real error. `--sweep` (SWEEP_PROS) adds the gemv
modules holding every launch variant (Gemv(..., sweep=True)), which the variant tests of
tests/gpu/test_gemv*.py and `bench/gemv_bench.py --sweep` load: the largest modules of all,
and each xdist worker compiled its own copy before.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from kernels import KERNEL_DIR
from kestrel_rt.cuda.gemv_variants import KERNELS, PLAIN, RESIDUAL, module_pros, persistent_pros

# The persistent gemvs' sources: one module per prologue (Gemv.module)
PERSISTENT = ("gemv_bulk", "gemv_ring")
# Prologues of the every-variant gemv modules that the GPU tests compile (test_gemv.py's
# variants: PLAIN; test_gemv_fused.py's: RESIDUAL)
SWEEP_PROS = (PLAIN, RESIDUAL)


def jobs(sweep: bool = False) -> list[tuple]:
    """("kernels", file) for each kernels/*.cu that KernelModules compiles whole,
    ("gemv", file, pro) for each gemv module (gemv_variants.module_pros)
    and ("persistent", source, pro) for each ring / bulk module; sweep: ("gemv-sweep", file,
    pro) too, every launch variant, for pro in SWEEP_PROS. The largest first, so that they do
    not end the run alone."""
    whole = sorted(p.stem for p in KERNEL_DIR.glob("*.cu")
                   if p.stem not in KERNELS and p.stem not in PERSISTENT)
    every = [("gemv-sweep", f, pro) for f in sorted(KERNELS) for pro in SWEEP_PROS] if sweep else []
    return (every + [("kernels", f) for f in whole]
            + [("gemv", f, pro) for f in sorted(KERNELS) for pro in module_pros(f)]
            + [("persistent", f, pro) for f in PERSISTENT for pro in persistent_pros(f)])


def compile_job(job: tuple) -> tuple[tuple, float, str | None]:
    """Compile one module on CUDA device 0: (job, seconds, error or None)."""
    import torch

    t0 = time.perf_counter()
    try:
        if job[0] == "kernels":
            from kestrel_rt.cuda.module import KernelModules

            KernelModules(torch.device("cuda")).compile_all((job[1],))
        else:
            from kestrel_rt.cuda.gemv import Gemv, gemv_device

            device = torch.device("cuda")
            gemv = Gemv(device, gemv_device(device, bulk=False, ring=False),
                        sweep=job[0] == "gemv-sweep")
            gemv.module(job[1], job[2])
        return job, time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001 (reported; the module's user raises it again)
        return job, time.perf_counter() - t0, f"{type(e).__name__}: {e}"


def precompile(workers: int | None = None, sweep: bool = False
               ) -> list[tuple[tuple, float, str | None]]:
    """Every job of jobs(sweep), `workers` processes at a time (default: the CPUs, at most
    16)."""
    todo = jobs(sweep)
    workers = workers or min(16, os.cpu_count() or 1, len(todo))
    ctx = multiprocessing.get_context("spawn")  # no CUDA state inherited from the caller
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(compile_job, todo))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="also the every-variant gemv modules (tests, gemv_bench --sweep)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = precompile(args.workers, args.sweep)
    for job, seconds, error in results:
        print(f"{'/'.join(map(str, job)):32s} {seconds:6.1f} s  {error or 'ok'}")
    failed = sum(error is not None for _, _, error in results)
    print(f"{len(results)} modules in {time.perf_counter() - t0:.1f} s, {failed} failed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
