"""The decode benchmark of issue 4, in one run on one GPU (dummy weights, real shapes).

    python bench/h200_decode.py --out DIR [--commit HASH] [--quick]

1. ceilings: device copy bandwidth (read + write) and a bf16 8192^3 matmul;
2. decode tok/s at batch 1 for qwen3-0.6b, qwen3-8b, qwen3-30b-a3b in bf16, int8, int4
   (kestrel_rt on the cupy backend with CUDA graphs; int8 / int4 quantized at load);
3. a batch sweep 1..64 for qwen3-8b bf16; prefill tok/s at 512, 2048, 8192 tokens;
4. for each: the bandwidth limit (bytes per step / copy bandwidth; MoE: the experts hit)
   and the fraction reached (prefill: the larger of the bandwidth and matmul limits);
5. transformers' eager `generate` on the same qwen3-8b shape (random weights, bf16);
6. the logits error of int8 / int4 against bf16 on the same dummy weights (prefill of
   4 x 64 random tokens: relative error, max abs, greedy argmax agreement);
7. Profiles (kestrel_sim.profile) of qwen3-8b (+ qwen3-0.6b as its draft) and qwen3-0.6b:
   decode (M = 1) over batches and contexts, verify (M = k + 1, k = 1..8), prefill.
Writes DIR/h200_decode.md, .json, profile_*.json and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import measure

from kestrel_rt.quant_error import logits_error
from kestrel_sim.profile import Fingerprint, Measurement, Profile

MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")
QUANTS = ("bf16", "int8", "int4")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL = (512, 2048, 8192)
CONTEXT = 128  # cached tokens per sequence in decode measurements (and a long one, 2048)


def build(name: str, quant: str, min_keys: int | None = None, **changes):
    """The model `kestrel generate` runs for a preset (kestrel_rt/runner.py: dummy weights,
    the device's default options), with the decode attention's keys per split at least
    min_keys where given, and the option `changes` (bench/ablation.py)."""
    from kestrel_rt.options import default_options
    from kestrel_rt.runner import build_model
    from kestrel_sim.models import preset

    q = None if quant == "bf16" else quant
    extra = {} if min_keys is None else {"attention_min_keys": min_keys}
    options = default_options("cuda", preset(name), q, **extra, **changes)
    return build_model(name, "cuda", torch.bfloat16, q, options, seed=0)


class Bench:
    def __init__(self, out: Path, quick: bool):
        self.out, self.quick = out, quick
        self.rows: list[dict] = []
        self.quant_rows: list[dict] = []
        self.errors: list[str] = []
        self.gen = torch.Generator().manual_seed(0)
        self.steps = 16 if quick else 200  # the loop's start and end weigh 1 / steps
        self.models, self.quants, self.with_transformers = MODELS, QUANTS, True
        self.breakdown, self.breakdowns = False, []  # per-kernel time of a decode step
        self.min_keys: int | None = None  # decode attention keys per split (None: default)

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def guard(self, what: str, fn, *args):
        """Run one section; a failure is logged and reported, the rest of the run goes on."""
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - a benchmark reports and continues
            self.errors.append(f"{what}: {type(err).__name__}: {err}")
            self.log(f"FAILED {what}\n{traceback.format_exc()}")
            torch.cuda.empty_cache()
            return None

    def add(self, section, model, quant, batch, tokens, r, limit_s, kind="bandwidth"):
        row = {"section": section, "model": model, "quant": quant, "batch": batch,
               "tokens": tokens, "tok_s": r["tok_s"], "ms": r["ms"],
               "limit_tok_s": None, "fraction": None, "limit": kind}
        if limit_s:
            row["limit_tok_s"] = batch * tokens / limit_s
            row["fraction"] = r["tok_s"] / row["limit_tok_s"]
        self.rows.append(row)
        self.log(json.dumps(row))

    def decode_limit_s(self, model, batch, m, context) -> float:
        nbytes = measure.weight_bytes_per_step(model, batch * m)
        nbytes += measure.kv_bytes_per_step(model.shape, batch, m, context)
        return nbytes / self.copy_bw

    # -- sections -------------------------------------------------------------------------
    def model_runs(self, name: str, quant: str, profile: list | None):
        self.log(f"build {name} {quant}")
        model = build(name, quant, self.min_keys)
        max_batch = max(BATCHES) if profile is not None or name == "qwen3-8b" else 1
        model.allocate_kv(max_batch, 2048 + 64)
        r = measure.time_steps(model, 1, 1, CONTEXT, self.steps, self.gen)
        self.add("decode b=1", name, quant, 1, 1, r, self.decode_limit_s(model, 1, 1, CONTEXT))
        if self.breakdown and quant in ("bf16", "int4"):
            self.breakdowns.append((name, quant, measure.kernel_breakdown(model, CONTEXT)))
        if name == "qwen3-8b" and quant == "bf16":
            for b in BATCHES[1:]:
                r = measure.time_steps(model, b, 1, CONTEXT, self.steps // 2, self.gen)
                self.add("batch sweep", name, quant, b, 1, r,
                         self.decode_limit_s(model, b, 1, CONTEXT))
        if profile is not None:
            self.profile_grid(model, profile)
            self.prefill(model, name, quant, profile)
        elif name == "qwen3-8b":
            self.prefill(model, name, quant, None)
        del model
        torch.cuda.empty_cache()

    def profile_grid(self, model, out: list):
        steps = 8 if self.quick else 16
        batches = (1, 4, 16, 64) if self.quick else BATCHES
        for context in (CONTEXT, 2048 - 32):
            for b in batches:
                r = measure.time_steps(model, b, 1, context, steps, self.gen)
                out.append(Measurement(stage="decode", batch=b, tokens_per_seq=1,
                                       context=context, ms=r["ms"], samples=r["samples"]))
        for b in (1, 4, 16):
            for k in range(1, 9):
                r = measure.time_steps(model, b, k + 1, CONTEXT, steps, self.gen)
                out.append(Measurement(stage="verify", batch=b, tokens_per_seq=k + 1,
                                       context=CONTEXT, ms=r["ms"], samples=r["samples"]))
        self.log(f"profile grid: {len(out)} measurements")

    def prefill(self, model, name, quant, profile: list | None):
        model.allocate_kv(1, max(PREFILL) + 16)
        for length in PREFILL:
            r = measure.time_prefill(model, length, 2 if self.quick else 3, self.gen)
            limit = max(
                (measure.weight_bytes_per_step(model, length)
                 + measure.kv_bytes_per_step(model.shape, 1, length, 0)) / self.copy_bw,
                measure.step_flops(model.shape, 1, length, 0) / self.peak_flops)
            self.add("prefill", name, quant, 1, length, r, limit, kind="max(bw, matmul)")
            if profile is not None:
                profile.append(Measurement(stage="prefill", batch=1, tokens_per_seq=length,
                                           context=0, ms=r["ms"], samples=r["samples"]))

    def quant_error(self, name: str):
        """Logits error of each quantized format against bf16, same dummy weights."""
        tokens = torch.randint(0, 32000, (4, 64), generator=self.gen)  # [B, M]
        ref = build(name, "bf16", self.min_keys)
        for quant in (q for q in self.quants if q != "bf16"):
            model = build(name, quant, self.min_keys)
            row = {"model": name, "quant": quant, **logits_error(ref, model, tokens)}
            self.quant_rows.append(row)
            self.log(json.dumps(row))
            del model
            torch.cuda.empty_cache()
        del ref
        torch.cuda.empty_cache()

    def transformers_baseline(self):
        from kestrel_sim.models import preset

        shape = preset("qwen3-8b")
        r = measure.transformers_generate(shape, (4, 12) if self.quick else (8, 40))
        limit = (measure.shape_weight_bytes(shape)
                 + measure.kv_bytes_per_step(shape, 1, 1, 32)) / self.copy_bw
        self.add("transformers eager", "qwen3-8b", "bf16", 1, 1, r, limit)

    # -- run --------------------------------------------------------------------------------
    def run(self, commit: str | None) -> None:
        props = torch.cuda.get_device_properties(0)
        self.copy_bw = measure.copy_bandwidth()
        self.peak_flops = measure.matmul_flops()
        self.log(f"{props.name}: copy {self.copy_bw / 1e9:.0f} GB/s, "
                 f"bf16 matmul {self.peak_flops / 1e12:.0f} TFLOP/s")
        profiles = {"qwen3-8b": [], "qwen3-0.6b": []}
        for name in self.models:
            for quant in self.quants:
                grid = profiles.get(name) if quant == "bf16" else None
                self.guard(f"{name} {quant}", self.model_runs, name, quant, grid)
                self.write(props.name, commit, profiles, final=False)  # partial results
            if len(self.quants) > 1 and "bf16" in self.quants:
                self.guard(f"{name} logits error", self.quant_error, name)
        if self.with_transformers:
            self.guard("transformers generate", self.transformers_baseline)
        self.write(props.name, commit, profiles)

    def fingerprint(self, device: str, model: str, commit, draft=None) -> Fingerprint:
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                check=False, capture_output=True, text=True, timeout=20,
            ).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            driver = None
        return Fingerprint(device=device, driver=driver, cuda=torch.version.cuda,
                           torch=torch.__version__, backend="cupy+graphs", model=model,
                           draft_model=draft, dtype="bfloat16",
                           date=time.strftime("%Y-%m-%d", time.gmtime()), git_commit=commit)

    def write(self, device: str, commit, profiles: dict, final: bool = True) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        small = profiles["qwen3-0.6b"]
        if small:
            Profile(fingerprint=self.fingerprint(device, "qwen3-0.6b", commit),
                    measurements=small).save(self.out / "profile_qwen3-0.6b_h200.json")
        if profiles["qwen3-8b"]:
            draft = [m.model_copy(update={"stage": "draft"}) for m in small
                     if m.stage == "decode"]
            Profile(fingerprint=self.fingerprint(device, "qwen3-8b", commit,
                                                 draft="qwen3-0.6b" if draft else None),
                    measurements=profiles["qwen3-8b"] + draft,
                    ).save(self.out / "profile_qwen3-8b_h200.json")
        meta = {"device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "commit": commit, "torch": torch.__version__, "cuda": torch.version.cuda,
                "copy_gbps": self.copy_bw / 1e9, "matmul_tflops": self.peak_flops / 1e12,
                "quick": self.quick, "errors": self.errors, "rows": self.rows,
                "decode_min_keys": self.min_keys,
                "quant_error": self.quant_rows,
                "breakdowns": [{"model": m, "quant": q, **b} for m, q, b in self.breakdowns]}
        (self.out / "h200_decode.json").write_text(json.dumps(meta, indent=1))
        table = render(meta)
        (self.out / "h200_decode.md").write_text(table)
        if final:
            print("\n" + table, flush=True)


def render(meta: dict) -> str:
    lines = [
        f"# Decode benchmark: {meta['device']}, {meta['date']}",
        "",
        (f"commit {meta['commit']}, torch {meta['torch']} (CUDA {meta['cuda']}); measured copy "
        f"bandwidth {meta['copy_gbps']:.0f} GB/s (read + write), bf16 matmul "
        f"{meta['matmul_tflops']:.0f} TFLOP/s. Dummy weights, real shapes; decode at "
        f"{CONTEXT} cached tokens; limit = bytes per step / copy bandwidth (MoE: experts hit; "
        "prefill: the larger of that and FLOPs / matmul rate); decode attention keys per split "
        f"at least {meta.get('decode_min_keys') or 'the default'}."),
        "",
        "| section | model | quant | batch | tokens | tok/s | step ms | limit tok/s | of limit |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in meta["rows"]:
        lim = f"{r['limit_tok_s']:.0f}" if r["limit_tok_s"] else "-"
        frac = f"{r['fraction']:.0%}" if r["fraction"] else "-"
        lines.append(f"| {r['section']} | {r['model']} | {r['quant']} | {r['batch']} | "
                     f"{r['tokens']} | {r['tok_s']:.1f} | {r['ms']:.3f} | {lim} | {frac} |")
    if meta.get("quant_error"):
        lines += ["", "Logits error against bf16 (same dummy weights; prefill of 4 x 64 tokens):",
                  "", "| model | quant | rel error | max abs | argmax agreement |",
                  "| --- | --- | ---: | ---: | ---: |"]
        lines += [f"| {r['model']} | {r['quant']} | {r['rel_error']:.4f} | {r['max_abs']:.3f} | "
                  f"{r['argmax_agreement']:.1%} |" for r in meta["quant_error"]]
    for b in meta.get("breakdowns", []):
        lines += ["", (f"Where a batch-1 decode step of {b['model']} {b['quant']} goes: "
                  f"{b['step_ms']:.3f} ms per step, kernels busy {b['busy_ms']:.3f} ms "
                  f"({sum(k[1] for k in b['kernels']):.0f} launches); top kernels:"), ""]
        lines += measure.breakdown_table(b, 12)
    if meta["errors"]:
        lines += ["", "Failed sections:", *[f"- {e}" for e in meta["errors"]]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer steps and cells (a smoke run)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--min-keys", type=int, default=None,
                    help="keys per context split of the decode attention, at least "
                         "(default: the backend's)")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-kernel time of a decode step (torch.profiler), bf16 and int4")
    args = ap.parse_args()
    bench = Bench(args.out, args.quick)
    bench.models, bench.quants = args.models.split(","), args.quants.split(",")
    bench.with_transformers = not args.no_transformers
    bench.breakdown = args.breakdown
    bench.min_keys = args.min_keys
    bench.run(args.commit)


if __name__ == "__main__":
    main()
