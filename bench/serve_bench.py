"""The serving engine on one GPU (kestrel_rt/serve): decode through it against the plain
benchmark, and a loaded scenario colocated against disaggregated (issue 24's table).

    python bench/serve_bench.py --out DIR [--commit HASH] [--seconds 20]

1. plain decode at batch 1 through the serving engine (one closed-loop request of a
   128-token prompt and 256 new tokens, qwen3-8b bf16): its decode rate (tokens after the
   first over the time from the first to the last) against bench/measure.py's overlapped
   loop on the same model;
2. a loaded scenario (scenarios/default.yaml's workload without speculation, Poisson
   arrivals for about --seconds of load) colocated (mixed schedule) and disaggregated on two
   CUDA streams, each with its metrics; disaggregated again with the GIL's switch interval
   at 0.5 ms instead of Python's 5 (the workers are threads of one process);
3. for every run, the share of each worker's wall time its traced stages cover, and of the
   time it had requests to serve (kestrel_sim/traced.py).
Writes DIR/serve_bench.md and .json and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from kestrel_rt.runner import build_model
from kestrel_rt.serve import serve
from kestrel_sim.gaps import gap_causes
from kestrel_sim.metrics import compute_metrics
from kestrel_sim.scenario import Scenario
from kestrel_sim.traced import traced_share

MODEL = "qwen3-8b"
# loaded runs: both modes at one max_batch; disaggregated on one GPU holds two copies of the
# weights and two KV caches, which at 64 sequences of up to 3,072 tokens exceed an H200
MAX_BATCH = 32


def scenario(name: str, serving: dict, arrivals: dict, requests: int, prompt: dict,
             output: dict) -> Scenario:
    return Scenario.load_from_dict({
        "name": name, "hardware": "h200", "model": MODEL, "serving": serving,
        "workload": {"arrivals": arrivals, "requests": requests, "prompt_tokens": prompt,
                     "output_tokens": output, "seed": 0}})


def decode_rate(trace) -> float:
    """Tokens after the first over the time from the first emission to the last."""
    rates = []
    for r in trace.requests:
        if len(r.emit_times) > 1:
            rates.append((sum(r.emit_counts) - r.emit_counts[0])
                         / (r.emit_times[-1] - r.emit_times[0]))
    return sum(rates) / len(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--seconds", type=float, default=20.0, help="of load per loaded run")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    rows, lines = [], []

    model = build_model(MODEL, "cuda")
    model.allocate_kv(1, 2048 + 64)
    bench = measure.time_steps(model, 1, 1, 128, 200, torch.Generator().manual_seed(0))
    del model
    one = scenario("plain-decode-b1", {"max_batch": 1},
                   {"process": "closed", "concurrency": 1}, 2,
                   {"dist": "fixed", "value": 128}, {"dist": "fixed", "value": 256})
    served = serve(one, "cuda")
    rate = decode_rate(served.trace)
    rows.append({"run": "plain decode b=1 through serve", "tok_s": rate,
                 "benchmark_tok_s": bench["tok_s"], "of_benchmark": rate / bench["tok_s"],
                 "coverage": traced_share(served.trace),
                 "rounds": sum(sp.kind == "decode" for sp in served.trace.spans),
                 "rounds_ahead": served.trace.meta.get("decode_rounds_ahead", 0)})
    print(json.dumps(rows[-1]), flush=True)
    served = None  # (serve() hands a finished run's GPU memory back: kestrel_rt/memory.py)

    rate_rps = 12.0
    n = int(rate_rps * args.seconds)
    # the third: the disaggregated workers' threads under a 0.5 ms GIL switch interval
    # (Python's 5 ms can hold a decode loop whose round finished behind the prefill loop)
    for mode, switch in (("colocated", None), ("disaggregated", None), ("disaggregated", 5e-4)):
        label = f"loaded, {mode}" + ("" if switch is None else f", GIL switch {switch * 1e3:g} ms")
        sc = scenario(f"loaded-{mode}", {"mode": mode, "max_batch": MAX_BATCH},
                      {"process": "poisson", "rate": rate_rps}, n,
                      {"dist": "lognormal", "mean": 512, "std": 256, "max": 2048},
                      {"dist": "lognormal", "mean": 192, "std": 96, "max": 1024})
        t0 = time.perf_counter()
        try:
            served = serve(sc, "cuda", switch_interval_s=switch)
        except Exception as err:  # noqa: BLE001 (the table says what failed; the others run)
            rows.append({"run": label, "error": f"{type(err).__name__}: {err}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        m = compute_metrics(served.trace, sc.slo)
        rows.append({"run": label, "requests": n, "wall_s": time.perf_counter() - t0,
                     "request_throughput": m.request_throughput,
                     "output_throughput": m.output_throughput,
                     "median_ttft_ms": m.median_ttft_ms, "p99_ttft_ms": m.p99_ttft_ms,
                     "median_tpot_ms": m.median_tpot_ms, "p99_tpot_ms": m.p99_tpot_ms,
                     "coverage": traced_share(served.trace),
                     "gaps": gap_causes(served.trace),
                     "captures_in_run": served.trace.meta.get("graph_captures_in_run")})
        print(json.dumps(rows[-1]), flush=True)
        served = None

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# Serving engine: {props.name}, {when}", "",
             (f"commit {args.commit}; `python bench/serve_bench.py --out DIR --commit HASH`; "
              f"{MODEL} bf16, dummy weights; loaded runs: max_batch {MAX_BATCH}, Poisson "
              f"{rate_rps:g} req/s for {args.seconds:g} s."), "",
             (f"Plain decode at batch 1 through the serving engine: {rows[0]['tok_s']:.1f} "
              f"tok/s, {rows[0]['of_benchmark']:.1%} of the benchmark loop's "
              f"{bench['tok_s']:.1f} tok/s ({rows[0]['rounds_ahead']} of its "
              f"{rows[0]['rounds']} rounds launched ahead of the host: "
              f"kestrel_rt/serve/ahead.py)."),
             "", ("| run | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | traced, of the "
                  "run / while working | "
                  "graphs captured in the run |"),
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows[1:]:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error']} |  |  |  |  |  |")
            continue
        cov = ", ".join(f"{w} {c['run']:.1%} / {c['working']:.1%}"
                        for w, c in r["coverage"].items())
        cap = r["captures_in_run"] or {"count": 0, "seconds": 0.0}
        lines.append(f"| {r['run']} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.0f} | {r['median_ttft_ms']:.0f} / "
                     f"{r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} / "
                     f"{r['p99_tpot_ms']:.1f} | {cov} | {cap['count']} "
                     f"({cap['seconds']:.2f} s) |")
    lines += ["", ("Time between a loop's steps while it had work (kestrel_sim/gaps.py: each gap "
              "counted under every cause it shows):"), "",
              ("| run | loop | gaps | in all ms | p50 / p99 ms | after a hand-over | rows changed "
              "| beside the other loop | none of these |"),
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows[1:]:
        for loop, g in (r.get("gaps") or {}).items():
            lines.append(f"| {r['run']} | {loop} | {g['gaps']} | {g['gap_s'] * 1e3:.0f} | "
                         f"{g['p50_ms']:.2f} / {g['p99_ms']:.2f} | "
                         f"{g['after_handover_s'] * 1e3:.0f} | {g['rows_changed_s'] * 1e3:.0f} | "
                         f"{g['beside_s'] * 1e3:.0f} | {g['none_s'] * 1e3:.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_bench.md").write_text("\n".join(lines) + "\n")
    (args.out / "serve_bench.json").write_text(json.dumps(
        {"device": props.name, "commit": args.commit, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
