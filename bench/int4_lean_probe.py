"""How fast an int4 gemv built around the mma fragments streams: a probe, not the runtime's.

    python bench/int4_lean_probe.py [--out DIR] [--settings 8.2,16.2,b8.8.8] [--layers 36]

bench/int4_lean_probe.cu reads int4 weights in a layout made for the tensor-core fragments
(`lean_pack`: each lane's 16-byte load is its A registers for four k16 steps; per row and
group one u32 of scale and zero point); its inner loop spends ~10 instructions per 32-bit
word of weights where the runtime's tuned int4 kernel (kernels/gemv_int4.cu) spends ~17. The
loads go to registers (int4_lean: bf16 arithmetic, or fp16 with `h`; a block per tile pair, or
persistent blocks) or through a bulk-copy ring of shared memory (int4_lean_bulk, one block per
SM, as kernels/gemv_bulk.cu feeds the bf16 gemvs). NOTES_decode.md (session 14) has what it
measured.

For each qwen3-8b decode shape at one row of x: the result against the fp32 product of the
same int4 weights (output poisoned with NaN first; relative error <= 1e-2; fp16 settings also
at x * 2^17), then the time per launch of each setting against the tuned kernel on weights of
the same shape, both in CUDA graphs over enough distinct weights to stream past the L2; last
the `--layers` qwen3-8b layers' four int4 matmuls in one graph, each shape at its best
setting, against the tuned kernel. Prints a table last; writes int4_lean_probe.json to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
STREAM_BYTES = 1.0e9


def _i32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 of the same bits."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


# Where the nibbles of a word go: nibble p (p = 0..3) holds (row g + dr, k 2t + dk) of the
# step and nibble 4 + p the next k. bf16 arithmetic: a_p's element pairs (a0, a1, a2, a3);
# fp16: a0, a2 (from w), a1, a3 (from w >> 8).
NIBBLES = {False: ((0, 0), (8, 0), (0, 8), (8, 8)), True: ((0, 0), (0, 8), (8, 0), (8, 8))}


def lean_pack(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, f16: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] (values 0..15), z [N, K / 128] (0..15), s [N, K / 128] fp16 -> (words int32
    [N / 16, K / 64, 32, 4], meta int32 [N / 16, K / 128, 8, 2]) in the probe kernels' layout
    (bench/int4_lean_probe.cu: its header, or its fp16 section's with f16). N % 32 == 0,
    K % 128 == 0."""
    n, k = q.shape
    if n % 32 or k % 128:
        raise ValueError(f"lean_pack needs N % 32 == 0 and K % 128 == 0, got {n} x {k}")
    tiles, chunks, groups = n // 16, k // 64, k // 128
    q5 = q.to(torch.int64).view(tiles, 16, chunks, 4, 16)  # [tile, row, chunk, step, k]
    g = torch.arange(8, device=q.device).view(8, 1)
    t = torch.arange(4, device=q.device).view(1, 4)
    words = torch.zeros(tiles, chunks, 8, 4, 4, dtype=torch.int64, device=q.device)
    for p, (dr, dk) in enumerate(NIBBLES[f16]):
        row, klo = g + dr, 2 * t + dk
        lo = q5[:, row, :, :, klo].permute(2, 3, 0, 1, 4)  # [tile, chunk, g, t, step]
        hi = q5[:, row, :, :, klo + 1].permute(2, 3, 0, 1, 4)
        words |= (lo << (4 * p)) | (hi << (16 + 4 * p))
    words = words.reshape(tiles, chunks, 32, 4)  # lane = 4 g + t
    s_bits = s.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    if f16:  # (scales of rows g, g + 8), (-(1024 + z) of rows g, g + 8), fp16
        z_bits = (-(z.float() + 1024)).half().view(torch.int16).to(torch.int64) & 0xFFFF
        pairs = [b.view(tiles, 2, 8, groups) for b in (s_bits, z_bits)]  # [tile, h, g, group]
        meta = torch.stack([p[:, 0] | (p[:, 1] << 16) for p in pairs], -1)  # [tile, g, grp, 2]
        meta = meta.permute(0, 2, 1, 3)
    else:  # (scale) | (bf16 of 128 + z) << 16, rows g and g + 8
        z_bits = (z.float() + 128).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        meta = (s_bits | (z_bits << 16)).view(tiles, 2, 8, groups).permute(0, 3, 2, 1)
    return _i32(words), _i32(meta.contiguous())


def lean_reference(q, z, s, x) -> torch.Tensor:
    """fp32 x [K] . ((q - z) * s)^T -> [N], group 128."""
    n, k = q.shape
    w = (q.float().view(n, k // 128, 128) - z.float()[..., None]) * s.float()[..., None]
    return w.view(n, k) @ x.float()


def parse_setting(text: str) -> tuple:
    """"KS.STAGES[.BPS]" (int4_lean, bf16 arithmetic), "hKS.STAGES[.BPS]" (int4_lean, fp16) or
    "bWARPS.S.IK" (int4_lean_bulk) -> ("r" | "h", KS, STAGES, BPS) or ("b", WARPS, S, IK).
    BPS: blocks per SM (persistent); 0 or absent: a block per tile pair."""
    kind = text[0] if text[:1] in ("b", "h") else "r"
    try:
        values = tuple(int(v) for v in text[kind != "r":].split("."))
    except ValueError:
        values = ()
    if kind != "b" and len(values) == 2:
        values += (0,)
    if len(values) != 3:
        raise ValueError(f"setting {text!r}: KS.STAGES[.BPS], hKS.STAGES[.BPS] or bWARPS.S.IK "
                         "expected")
    return (kind, *values)


def label(setting: tuple) -> str:
    kind, *values = setting
    if kind != "b" and values[2] == 0:
        values = values[:2]
    return ("" if kind == "r" else kind) + ".".join(map(str, values))


def is_f16(setting: tuple) -> bool:
    return setting[0] == "h"


def fits(setting: tuple, n: int, k: int, max_shared: int = 227 * 1024) -> bool:
    """The kernel takes [N, K] at this setting (and its shared memory fits)."""
    kind, a, _, c = setting
    groups = k // 128
    if kind != "b":
        return n % 32 == 0 and groups % a == 0
    return (n % 32 == 0 and groups % c == 0 and c % a == 0
            and bulk_shared(setting, k) + 2048 <= max_shared)


def bulk_shared(setting: tuple, k: int) -> int:
    """Dynamic shared memory of int4_lean_bulk: the ring and x."""
    _, _, slots, ik = setting
    return slots * 2 * ik * (1024 + 64) + 2 * k


class Lean:
    """The probe kernels compiled for `settings` (parse_setting's tuples), launched on torch's
    current stream."""

    def __init__(self, settings: list[tuple]):
        import cupy

        from kernels import KERNEL_DIR

        self.cupy, self.streams = cupy, {}
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.names = {st: self.kernel(st) for st in settings}
        code = (ROOT / "bench" / "int4_lean_probe.cu").read_text()
        self.module = cupy.RawModule(code=code, options=("-std=c++17", f"-I{KERNEL_DIR}"),
                                     name_expressions=sorted(set(self.names.values())))
        self.module.compile()
        self.ready: dict = {}  # kernel -> dynamic shared bytes allowed

    @staticmethod
    def kernel(setting: tuple) -> str:
        kind, a, b, c = setting
        if kind == "b":
            return f"int4_lean_bulk<{a}, {b}, {c}>"
        return f"int4_lean<{a}, {b}, {'true' if kind == 'h' else 'false'}>"

    def __call__(self, words, meta, x, y, setting: tuple) -> None:
        from kestrel_rt.cuda.module import current_stream, i32, ptr, set_max_dynamic_shared

        n, k = words.shape[0] * 16, words.shape[1] * 64
        if not fits(setting, n, k):
            raise ValueError(f"setting {label(setting)} does not fit {n} x {k}")
        kind, a, _, c = setting
        name = self.names[setting]
        fn = self.module.get_function(name)
        if kind == "b":
            grid, block, shared = (min(self.sms, n // 32),), (32 * (a + 1),), bulk_shared(setting, k)
        else:
            grid = (n // 32 if c == 0 else min(n // 32, c * self.sms),)
            block, shared = (32 * a,), 2 * k
        if self.ready.get(name, 0) < shared:
            set_max_dynamic_shared(fn, shared)
            self.ready[name] = shared
        stream = current_stream(self.cupy, torch.cuda.current_device(), self.streams)
        fn(grid, block, (ptr(words), ptr(meta), ptr(x), ptr(y), i32(n), i32(k)),
           shared_mem=shared, stream=stream)


def random_int4(n: int, k: int, gen: torch.Generator, dev: str = "cuda"):
    """q, z, s of a random int4 weight [N, K] (scales ~ 2e-3, as a 0.02-std weight's)."""
    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (n, k // 128), device=dev, dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // 128, device=dev, generator=gen) * 2e-3 + 1e-3).half()
    return q, z, s


def check(lean: Lean, n: int, k: int, settings, gen) -> dict:
    """Relative error of every setting against lean_reference on one random weight (NaN
    where any output was left unwritten)."""
    q, z, s = random_int4(n, k, gen)
    packed = {f16: lean_pack(q, z, s, f16) for f16 in (False, True)}
    x = torch.randn(k, device="cuda", generator=gen).bfloat16()
    ref = lean_reference(q, z, s, x)
    errors = {}
    for st in settings:
        if not fits(st, n, k):
            continue
        # fp16 x: also at 2^17 times the size (beyond fp16's range: the kernel's 2^-e scale)
        for scale in (1.0, 2.0**17) if is_f16(st) else (1.0,):
            y = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
            lean(*packed[is_f16(st)], x * scale, y, st)
            torch.cuda.synchronize()
            err = float((y.float() / scale - ref).norm() / ref.norm())
            errors[label(st)] = err if math.isnan(err) else max(errors.get(label(st), 0.0), err)
    return errors


def lean_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * (k // 128) * 4 + 2 * (n + k)


def time_lean(lean: Lean, n: int, k: int, setting, gen) -> float:
    from kestrel_rt.cuda.timing import time_graph

    per = lean_bytes(n, k)
    copies = max(2, min(64, math.ceil(STREAM_BYTES / per)))
    ws = [(torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), device="cuda",
                         dtype=torch.int32, generator=gen),
           lean_pack(*random_int4(32, k, gen), is_f16(setting))[1].repeat(n // 32, 1, 1, 1))
          for _ in range(copies)]
    x = torch.randn(k, device="cuda", generator=gen).bfloat16()
    ys = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in ws]

    def run():
        for (w, m), y in zip(ws, ys):
            lean(w, m, x, y, setting)

    return time_graph(run) / copies


def time_tuned(gemv, n: int, k: int, gen) -> tuple[float, int]:
    from gemv_bench import random_weight, weight_bytes

    from kestrel_rt.cuda.timing import time_graph

    w0 = random_weight("int4", n, k, gen)
    per = weight_bytes(w0) + 2 * (n + k)
    copies = max(2, min(64, math.ceil(STREAM_BYTES / per)))
    ws = [w0] + [random_weight("int4", n, k, gen) for _ in range(copies - 1)]
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in ws]

    def run():
        for w, o in zip(ws, outs):
            gemv.int4(x, w, out=o)

    return time_graph(run) / copies, per


def time_layers(lean: Lean, gemv, best: dict, layers: int, gen) -> tuple[float, float, int, int]:
    """The four shapes of `layers` layers in one graph: (lean s, tuned s, lean bytes, tuned
    bytes)."""
    from gemv_bench import random_weight, weight_bytes

    from kestrel_rt.cuda.timing import time_graph

    xs = {k: torch.randn(k, device="cuda", generator=gen).bfloat16() for _, k in SHAPES.values()}
    lw, tw = [], []
    for _ in range(layers):
        for name, (n, k) in SHAPES.items():
            words = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 64, 32, 4), device="cuda",
                                  dtype=torch.int32, generator=gen)
            meta = lean_pack(*random_int4(32, k, gen), is_f16(best[name]))[1].repeat(
                n // 32, 1, 1, 1)
            lw.append((words, meta, torch.empty(n, device="cuda", dtype=torch.bfloat16),
                       best[name]))
            tw.append((random_weight("int4", n, k, gen),
                       torch.empty(1, n, device="cuda", dtype=torch.bfloat16)))

    def run_lean():
        for words, meta, y, st in lw:
            lean(words, meta, xs[words.shape[1] * 64], y, st)

    def run_tuned():
        for w, o in tw:
            gemv.int4(xs[w.shape[1]].view(1, -1), w, out=o)

    lean_s, tuned_s = time_graph(run_lean), time_graph(run_tuned)
    lb = sum(lean_bytes(w.shape[0] * 16, w.shape[1] * 64) for w, *_ in lw)
    tb = sum(weight_bytes(w) + 2 * sum(w.shape) for w, _ in tw)
    return lean_s, tuned_s, lb, tb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/int4_lean"))
    ap.add_argument("--settings",
                    default="8.2,16.2,8.2.2,8.3.2,h8.2,h16.2,h8.2.2,h8.3.2,h16.2.1,h4.3.4,b16.4.16",
                    help="KS.STAGES[.BPS] (int4_lean), hKS.STAGES[.BPS] (its fp16 arithmetic) or "
                         "bWARPS.S.IK (int4_lean_bulk), comma separated")
    ap.add_argument("--layers", type=int, default=36)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("int4_lean_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from measure import copy_bandwidth

    from kestrel_rt.cuda.linear import Gemv

    settings = [parse_setting(s) for s in args.settings.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    lean, gemv = Lean(settings), Gemv("cuda")
    rows, best = [], {}
    for name, (n, k) in SHAPES.items():
        errors = check(lean, n, k, settings, gen)
        tuned_s, tuned_b = time_tuned(gemv, n, k, gen)
        row = {"shape": name, "n": n, "k": k, "errors": errors,
               "tuned_us": tuned_s * 1e6, "tuned_of_copy": tuned_b / tuned_s / copy_bw,
               "lean_us": {}}
        for st in settings:
            if fits(st, n, k):
                row["lean_us"][label(st)] = time_lean(lean, n, k, st, gen) * 1e6
        key = min(row["lean_us"], key=row["lean_us"].get)
        best[name] = parse_setting(key)
        row["best"] = key
        row["lean_of_copy"] = lean_bytes(n, k) / (row["lean_us"][key] / 1e6) / copy_bw
        rows.append(row)
        print(json.dumps(row), flush=True)
    lean_s, tuned_s, lb, tb = time_layers(lean, gemv, best, args.layers, gen)
    layers = {"layers": args.layers, "lean_us": lean_s * 1e6, "tuned_us": tuned_s * 1e6,
              "lean_of_copy": lb / lean_s / copy_bw, "tuned_of_copy": tb / tuned_s / copy_bw}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int4_lean_probe.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "copy_gbps": copy_bw / 1e9, "rows": rows,
         "layers": layers}, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, copy {copy_bw / 1e9:.0f} GB/s; one row of x")
    print("| shape | tuned us | of copy | lean best | lean us | of copy | max rel error |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['shape']} | {r['tuned_us']:.2f} | {r['tuned_of_copy']:.1%} | {r['best']} | "
              f"{r['lean_us'][r['best']]:.2f} | {r['lean_of_copy']:.1%} | "
              f"{max(r['errors'].values()):.2e} |")
    print(f"| {args.layers} layers | {layers['tuned_us']:.1f} | {layers['tuned_of_copy']:.1%} | "
          f"per shape | {layers['lean_us']:.1f} | {layers['lean_of_copy']:.1%} | |")
    bad = [r["shape"] for r in rows
           if not all(e <= 1e-2 for e in r["errors"].values())]  # NaN fails too
    if bad:
        print(f"int4_lean_probe: wrong results for {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
