"""Issue 22, item 3: disaggregated prefill and decode over two GPUs against colocated serving,
measured and predicted, at light load and at saturation, and where the KV hand-over sits in
the time to first token.

    python bench/disagg_2gpu.py --out DIR [--commit HASH] [--steps link,runs,table]
                                [--runs colocated-light,disagg-light,...]

Needs two GPUs of one host (H200s: the scenarios' hardware and profile); the table step
alone rereads DIR anywhere. Steps:

1. link: `kestrel calibrate --model qwen3-8b` over a grid of kv_transfer only
   (DIR/link_grid.yaml): the target's KV rows of 256..32768 tokens copied within cuda:0
   and from cuda:0 to cuda:1; the links fitted to each (ProfileFits.link) go to
   DIR/link.json. About 1.5 minutes.
2. runs: `kestrel run SCENARIO --on both --raw-trace --trace full` of the prediction pair
   scenarios/validation/predictions/{colocated,disagg}-2gpu.yaml (qwen3-8b, no draft,
   4096-token prompts, 64..128 output tokens), both on cuda:0 and cuda:1 (serving.devices):
   colocated = a colocated worker on each GPU; disaggregated = prefill on cuda:0, decode on
   cuda:1, the simulator's link the one measured in step 1 between the GPUs (the hardware's
   nvlink without DIR/link.json). Light load: 2 req/s, 60 requests; saturation: 12 req/s,
   200 requests (past what either serves). Each run writes DIR/RUN/; about 1.5 to 2.5
   minutes each with the model builds.
3. table: measured against predicted throughput, TTFT and TPOT with errors (each run's
   comparison.json), and TTFT split into its parts on both sides (each run's traces):
   DIR/disagg_2gpu.md and .json, printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kestrel_sim.trace import Trace

SCENARIOS = ROOT / "scenarios" / "validation" / "predictions"
TWO_GPUS = "serving.devices=[cuda:0, cuda:1]"
LOADS = {"light": ["workload.arrivals.rate=2", "workload.requests=60"],
         "saturated": ["workload.arrivals.rate=12", "workload.requests=200"]}
RUNS = {f"{mode}-{load}": (SCENARIOS / f"{mode}-2gpu.yaml", sets)
        for load, sets in LOADS.items() for mode in ("colocated", "disagg")}
LINK_GRID = """name: link
timing: {warmup: 2, repeats: 7, cpu_warmup: 1, cpu_repeats: 3}
kv_transfer: {tokens: [256, 1024, 4096, 16384, 32768], between_gpus: true}
"""
METRICS = [("request_throughput", "req/s"), ("output_throughput", "tok/s"),
           ("mean_ttft_ms", "ms"), ("median_ttft_ms", "ms"), ("p99_ttft_ms", "ms"),
           ("mean_tpot_ms", "ms"), ("median_tpot_ms", "ms")]
PARTS = ("queue", "prefill", "link_wait", "kv_transfer", "delivery")


def kestrel(*args: str) -> int:
    exe = shutil.which("kestrel")
    cmd = [exe] if exe else [sys.executable, "-c", "from kestrel_cli.app import app; app()"]
    print("$ kestrel " + " ".join(args), flush=True)
    return subprocess.run(cmd + list(args), cwd=ROOT, check=False).returncode


def measure_link(out: Path) -> dict | None:
    from kestrel_sim.costs.profile import ProfileFits
    from kestrel_sim.profile import Profile

    (out / "link_grid.yaml").write_text(LINK_GRID)
    profile_path = out / "link_profile.json"
    if kestrel("calibrate", "--model", "qwen3-8b", "--grid", str(out / "link_grid.yaml"),
               "--out", str(profile_path)) != 0 and not profile_path.exists():
        return None
    fits = ProfileFits(Profile.load(profile_path))
    links = {name: fit.model_dump() if fit else None
             for name, fit in (("between_gpus", fits.link(True)),
                               ("within_gpu", fits.link(False)))}
    (out / "link.json").write_text(json.dumps(links, indent=1))
    print(f"link: {links}", flush=True)
    return links


def run_all(out: Path, names: list[str]) -> None:
    link_file = out / "link.json"
    link = json.loads(link_file.read_text()).get("between_gpus") if link_file.exists() else None
    for name in names:
        scenario, sets = RUNS[name]
        sets = [*sets, TWO_GPUS]
        if name.startswith("disagg") and link:
            sets.append(f"serving.link={{bandwidth_gb_s: {link['bandwidth_gb_s']:.6g}, "
                        f"latency_us: {link['latency_us']:.6g}}}")
        args = ["run", str(scenario), "--on", "both", "--raw-trace", "--trace", "full",
                "--overwrite", "--out", str(out / name)]
        for s in sets:
            args += ["--set", s]
        t0 = time.perf_counter()
        code = kestrel(*args)  # 1: a checked metric past its tolerance (still written)
        print(f"{name}: exit {code} in {time.perf_counter() - t0:.0f} s", flush=True)


def ttft_parts(trace: Trace) -> dict[str, float]:
    """Mean milliseconds of each part of TTFT, over requests with a first token: queue
    (arrival to first scheduled), prefill (to the end of its last prefill span before the
    first token, the draft's pass included), link_wait (to its first kv_transfer's start:
    waiting for the link or a decode slot), kv_transfer (the copy), delivery (copy end, or
    prefill end when colocated, to the first token at the client). The parts sum to TTFT."""
    prefills: dict[int, list[float]] = {}
    copies: dict[int, list[tuple[float, float]]] = {}
    for s in trace.spans:
        for rid in s.requests:
            if s.kind == "prefill":
                prefills.setdefault(rid, []).append(s.end)
            elif s.kind == "kv_transfer":
                copies.setdefault(rid, []).append((s.start, s.end))
    sums, n = dict.fromkeys(PARTS + ("ttft",), 0.0), 0
    for rec in trace.requests:
        if not rec.emit_times or rec.prefill_start is None:
            continue
        first = rec.emit_times[0]
        copy = min(copies.get(rec.id, []), default=None)
        cut = (copy[0] if copy else first) + 1e-9
        ends = [e for e in prefills.get(rec.id, []) if e <= cut]
        if not ends:
            continue  # a sampled trace without its prefill span
        done = max(ends)
        sums["queue"] += rec.prefill_start - rec.arrival
        sums["prefill"] += done - rec.prefill_start
        if copy:
            sums["link_wait"] += copy[0] - done
            sums["kv_transfer"] += copy[1] - copy[0]
            sums["delivery"] += first - copy[1]
        else:
            sums["delivery"] += first - done
        sums["ttft"] += first - rec.arrival
        n += 1
    return {k: 1e3 * v / n for k, v in sums.items()} if n else {}


def table(out: Path, names: list[str]) -> tuple[str, dict]:
    data, lines = {}, []
    lines.append("| run | metric | measured | predicted | error % |")
    lines.append("| --- | --- | ---: | ---: | ---: |")
    for name in names:
        doc_path = out / name / "comparison.json"
        if not doc_path.exists():
            lines.append(f"| {name} | (not run) | | | |")
            continue
        doc = json.loads(doc_path.read_text())
        rows = {r["metric"]: r for r in doc["rows"]}
        data[name] = {"device": doc["fingerprint"].get("device"), "metrics": {}, "ttft": {}}
        for metric, unit in METRICS:
            r = rows.get(metric, {})
            data[name]["metrics"][metric] = r
            fmt = (lambda v: "" if v is None else f"{v:.3g}")
            lines.append(f"| {name} | {metric} ({unit}) | {fmt(r.get('measured'))} | "
                         f"{fmt(r.get('predicted'))} | {fmt(r.get('error_pct'))} |")
    lines += ["", "TTFT parts, mean ms (share of mean TTFT): measured / predicted", "",
              "| run | " + " | ".join(PARTS) + " | TTFT |",
              "| --- |" + " ---: |" * (len(PARTS) + 1)]
    for name, entry in data.items():
        sides = {}
        for side in ("hardware", "sim"):
            path = out / name / side / "kestrel_trace.json"
            sides[side] = ttft_parts(Trace.load(path)) if path.exists() else {}
        entry["ttft"] = sides
        cells = []
        for part in PARTS + ("ttft",):
            text = []
            for side in ("hardware", "sim"):
                p = sides[side]
                text.append(f"{p[part]:.1f} ({100 * p[part] / p['ttft']:.0f}%)"
                            if p and p["ttft"] else "-")
            cells.append(" / ".join(text))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines), data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None, help="the code's commit (git rev-parse HEAD)")
    ap.add_argument("--steps", default="link,runs,table")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"of {', '.join(RUNS)}")
    args = ap.parse_args()
    steps, names = args.steps.split(","), args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"unknown run {unknown[0]}: expected some of {', '.join(RUNS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if {"link", "runs"} & set(steps):
        import torch

        if torch.cuda.device_count() < 2:
            sys.exit(f"needs two GPUs of one host; this machine has "
                     f"{torch.cuda.device_count()} (the table step alone rereads --out)")
    if "link" in steps:
        measure_link(args.out)
    if "runs" in steps:
        run_all(args.out, names)
    if "table" in steps:
        text, data = table(args.out, names)
        commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                               capture_output=True, text=True,
                                               check=False).stdout.strip()
        head = (f"# Disaggregated over two GPUs against colocated (issue 22)\n\ncommit "
                f"{commit}, `python bench/disagg_2gpu.py --out {args.out}`\n\n")
        (args.out / "disagg_2gpu.md").write_text(head + text + "\n")
        (args.out / "disagg_2gpu.json").write_text(json.dumps(
            {"commit": commit, "runs": data}, indent=1))
        print(head + text)


if __name__ == "__main__":
    main()
