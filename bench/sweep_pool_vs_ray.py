"""A 1,000-scenario `kestrel sweep`: the local process pool against Ray, on this machine.

    python bench/sweep_pool_vs_ray.py    # writes bench/results/sweep_pool_vs_ray.md
    python bench/sweep_pool_vs_ray.py --ray ray://head:10001    # the Ray side on a cluster

The grid is the default scenario at 20 requests a point over spec.k (10 values) x arrival
rate (10) x workload seed (10): 1,000 small simulations. Each side runs the real command
(`kestrel sweep ... -o DIR`, a fresh process and a fresh folder), timed from start to exit,
so a side's fixed costs (Ray starting, workers importing kestrel) are in its time; a 2-point
sweep on each side measures those fixed costs alone. Then the Ray sweep is run again into its
own folder: a resumed sweep, with nothing left to run. Both sides' sweep.json must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "default.yaml"
TEN = ",".join(str(i) for i in range(1, 11))
GRID = ["--set", f"spec.k={TEN}",
        "--set", "workload.arrivals.rate=" + ",".join(str(2 * i) for i in range(1, 11)),
        "--set", "workload.seed=" + ",".join(str(i) for i in range(10))]
TINY_GRID = ["--set", "spec.k=1,2"]


def sweep(out: Path, grid: list[str], requests: int, extra: list[str]) -> float:
    """Seconds for one `kestrel sweep` process, start to exit."""
    command = [sys.executable, "-m", "kestrel_cli.app", "sweep", str(SCENARIO), "-o", str(out),
               "--set", f"workload.requests={requests}", *grid, *extra]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return seconds


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        names = [line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} CPUs, {memory:.0f} GiB, Python {platform.python_version()}"


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.strip()
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="requests per scenario")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(),
                        help="local processes, and the local Ray instance's CPUs")
    parser.add_argument("--ray", default="local", help="Ray address (default: a local instance)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        "sweep_pool_vs_ray.md")
    args = parser.parse_args()
    import ray

    ray_args = ["--ray", args.ray] + (["-j", str(args.jobs)] if args.ray == "local" else [])
    pool_args = ["-j", str(args.jobs)]
    work = Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    try:
        load = os.getloadavg()[0]
        rows = [
            ("local pool, 2 points", sweep(work / "p2", TINY_GRID, args.requests, pool_args), 2),
            ("Ray, 2 points", sweep(work / "r2", TINY_GRID, args.requests, ray_args), 2),
            ("local pool, 1,000 points", sweep(work / "pool", GRID, args.requests, pool_args),
             1000),
            ("Ray, 1,000 points", sweep(work / "ray", GRID, args.requests, ray_args), 1000),
            ("Ray, 1,000 points resumed (all on disk)",
             sweep(work / "ray", GRID, args.requests, ray_args), 0),
        ]
        same = (json.loads((work / "pool" / "sweep.json").read_text())
                == json.loads((work / "ray" / "sweep.json").read_text()))
        load = max(load, os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    local = args.ray == "local"
    command = "python bench/sweep_pool_vs_ray.py" + ("" if local else f" --ray {args.ray}")
    ray_side = f"a local Ray instance with {args.jobs} CPUs" if local else f"Ray at {args.ray}"
    now = datetime.now(timezone.utc)
    title = f"# kestrel sweep: local process pool vs Ray, {now:%Y-%m-%d %H:%M} UTC"
    setup = (f"Machine: {machine()}; load average up to {load:.1f} during the run (other work "
             f"shares this machine). Commit {commit()}, Ray {ray.__version__}.")
    how = (f"`{command}` (--requests {args.requests}, --jobs {args.jobs}): "
           f"scenarios/default.yaml at {args.requests} requests a point over spec.k (10 values) "
           f"x arrival rate (10) x seed (10); local pool: `-j {args.jobs}`; Ray: {ray_side}. "
           "Each time is one `kestrel sweep` process, start to exit, into a new folder.")
    lines = [title, "", setup, "", how, "",
             "| run | points run | wall s | points/s |", "| --- | ---: | ---: | ---: |"]
    for name, seconds, points in rows:
        rate = f"{points / seconds:.1f}" if points else "-"
        lines.append(f"| {name} | {points} | {seconds:.1f} | {rate} |")
    reading = ("The 2-point rows are each side's fixed cost (a process starting; for Ray, "
               "also an instance and its workers starting, or a cluster connected to). The "
               "resumed row is the work outside the simulations, paid by both sides: every "
               "grid point validated (its scenario read and checked), the points read back, "
               "and the summary files written.")
    lines += ["", f"sweep.json of the two 1,000-point sweeps equal: {'yes' if same else 'NO'}.",
              "", reading, ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    if not same:
        sys.exit("the local pool and Ray gave different results")


if __name__ == "__main__":
    main()
