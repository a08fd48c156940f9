"""How well a profile's fits predict steps they did not see: the fit report.

Held-out error: by default leave-one-out. Each measurement of a stage is held out in
turn, the stage is refitted on the others (the coefficients it borrows, decode's KV rate
and prefill's attention rate, stay those of the full fit), and the held-out step is
predicted. `every=k` instead holds out every k-th measurement of each stage (1-based,
in file order: the k-th, 2k-th, ...) and fits once on the rest. Errors are absolute
percentages of the measured ms; per stage and device the median and the maximum, for the
physical terms alone and with the measured correction (what the simulator uses).

A held-out point at the edge of a stage's grid is an extrapolation (the prefill rows
of the bundled profiles are three lengths, so each held-out one is): the maximum says how
far a fit may be trusted beyond its grid, the median how well it interpolates.

When a profile has mixed rows the report adds a row per device: the error, on all of them
(none of which it saw), of the pricing the simulator uses without mixed rows (ProfileCost
without its mixed fit, profile.py): `mixed (step + chunks)` where the runtime runs a step's
prompt chunks one forward each (RuntimeInfo.chunks "per_chunk": the step's forward, then
each chunk's on the prefill fit), else `mixed (marginal rule)` (the step plus the chunk's
marginal cost on the prefill fit); a GPU step at the runtime's graph bucket, as simulated.

When it has overlap rows, a line gives the contention fitted to them (contention.py): the
law per side and the error of each row's slowdown, predicted with the law fitted on the
others, over all rows and per side (decode, prefill; draft and prefill/draft where the
profile has the draft's rows).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kestrel_sim.costs.base import Chunk
from kestrel_sim.costs.profile import ProfileCost, ProfileFits, StageModel
from kestrel_sim.profile import Measurement, Profile


@dataclass
class StageReport:
    stage: str
    device: str
    rows: int
    held_out: int
    physical_median_pct: float | None
    physical_max_pct: float | None
    corrected_median_pct: float | None
    corrected_max_pct: float | None
    terms: dict[str, float] = field(default_factory=dict)  # effective rates, see RATE_UNITS
    how: dict[str, str] = field(default_factory=dict)


WITHOUT_MIXED = ("decode", "verify", "correction", "prefill")  # the stages a mixed step uses
RATE_UNITS = {"overhead": "ms", "weights": "TB/s", "gemm": "TFLOP/s", "serial": "TFLOP/s",
              "kv": "TB/s", "attention": "TFLOP/s"}


@dataclass
class FitReport:
    profile: str
    method: str
    stages: list[StageReport]
    link: dict[str, float] | None = None
    overlap: dict | None = None  # the law per side, rows, held-out error of the slowdowns
    #                              (all rows, and per side: rows, median, max)
    rounds: dict | None = None  # the round overhead fitted, rows, held-out error of rounds

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """A plain-text table: one line per stage and device."""
        head = (f"{'stage':<22}{'dev':<5}{'rows':>5}{'held':>5}  {'physical med/max %':>19}  "
                f"{'corrected med/max %':>20}  effective rates")
        lines = [f"fit report: {self.profile} (held out: {self.method})", head]
        for s in self.stages:
            rates = ", ".join(f"{t} {v:.3g}{_MARKS.get(s.how.get(t, ''), '')} {RATE_UNITS[t]}"
                              for t, v in s.terms.items())
            lines.append(f"{s.stage:<22}{s.device:<5}{s.rows:>5}{s.held_out:>5}  "
                         f"{_pair(s.physical_median_pct, s.physical_max_pct):>19}  "
                         f"{_pair(s.corrected_median_pct, s.corrected_max_pct):>20}  {rates}")
        lines.append("  * the device's stated rate (hardware description): not separable "
                     "from the other terms, or fitted no faster;  ^ borrowed from another "
                     "stage (decode's KV rate, prefill's attention rate)")
        if self.link:
            lines.append(f"kv_transfer link: {self.link['bandwidth_gb_s']:.3g} GB/s, "
                         f"{self.link['latency_us']:.3g} us latency")
        for kind, r in (self.rounds or {}).items():
            lines.append(f"{kind} round overhead: {r['fixed_ms']:.3g} ms + {r['per_seq_ms']:.3g} "
                         f"ms per sequence from {r['rows']} rounds; a round (stages + "
                         f"overhead) held out med/max {_pair(r['median_pct'], r['max_pct'])} %")
        if self.overlap:
            o = self.overlap
            if o.get("law") == "interleave":
                law = "interleave, " + ", ".join(
                    f"{side} {a:.2f} x (T_other / T)^{b:.2f}" for side, (a, b) in o["ratio"].items())
            else:
                law = "shares, lam " + ", ".join(f"{side} {v:.2f}" for side, v in o["serial"].items())
            others = ", ".join(f"{k} {v:.1f}%" for k, v in o.get("law_held_out_pct", {}).items())
            sides = "; ".join(f"{k} {n} rows {_pair(med, mx)} %"
                              for k, (n, med, mx) in o.get("per_side", {}).items())
            lines.append(f"overlap: {law} from {o['rows']} rows; slowdown held out "
                         f"med/max {_pair(o['median_pct'], o['max_pct'])} %"
                         + (f" (median per law: {others})" if others else "")
                         + (f"; per side med/max: {sides}" if sides else ""))
        return "\n".join(lines)


def _nth(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


_MARKS = {"at the stated rate": "*", "not measured: at the stated rate": "*", "borrowed": "^"}


def _pair(med: float | None, mx: float | None) -> str:
    return "n/a" if med is None else f"{med:.1f} / {mx:.1f}"


def _rates(model: StageModel) -> dict[str, float]:
    """Coefficients as the rates they stand for (TB/s, TFLOP/s); 0-rate terms left out."""
    tm = model.terms
    out = {"overhead": tm.overhead}
    for t in ("weights", "gemm", "serial", "kv", "attention"):
        coef = getattr(tm, t)
        if coef > 0:
            out[t] = 1e-9 / coef  # ms per byte (flop) -> 1e12 bytes (flops) per second
    return out


def _predict(model: StageModel, mm: Measurement, physical: bool) -> float:
    if model.stage == "mixed":
        ms = model.physical_mixed_ms if physical else model.mixed_ms
        return ms(mm.batch, mm.tokens_per_seq, mm.context, Chunk(*mm.chunk))
    if physical:
        return model.physical_ms(mm.batch, mm.tokens_per_seq, mm.context)
    return model.ms(mm.batch, mm.tokens_per_seq, mm.context)


def _stats(errs: list[float]) -> tuple[float | None, float | None]:
    if not errs:
        return None, None
    return float(np.median(errs)), float(np.max(errs))


def fit_report(profile: Profile, name: str = "<profile>", every: int | None = None,
               fits: ProfileFits | None = None) -> FitReport:
    """Per stage and device: held-out error of the fit (see the module docstring)."""
    fits = fits or ProfileFits(profile)
    out = []
    for (stage, device), full in fits.models.items():
        rows = profile.rows(stage, device)
        held = list(range(len(rows))) if every is None else list(range(every - 1, len(rows), every))
        phys, corr = [], []
        if every is not None and len(held) < len(rows):
            rest = [mm for i, mm in enumerate(rows) if i not in set(held)]
            part = fits.fit(stage, device, rest)
            models = dict.fromkeys(held, part)
        else:
            models = {i: fits.fit(stage, device, rows[:i] + rows[i + 1:])
                      for i in held if len(rows) > 1}
        for i, model in models.items():
            mm = rows[i]
            phys.append(abs(_predict(model, mm, True) / mm.ms - 1) * 100)
            corr.append(abs(_predict(model, mm, False) / mm.ms - 1) * 100)
        out.append(StageReport(stage, device, len(rows), len(models), *_stats(phys),
                               *_stats(corr), _rates(full), dict(full.terms.how)))
    for device in sorted({mm.device for mm in profile.measurements if mm.stage == "mixed"}):
        if ("prefill", device) in fits.models:
            out.append(_without_mixed_fit(fits, device))
    link = fits.link()
    return FitReport(name, "leave-one-out" if every is None else f"every {_nth(every)} row",
                     out, link.model_dump() if link else None, _overlap(fits), _rounds(fits))


def _rounds(fits: ProfileFits) -> dict | None:
    """Per kind (speculative, decode): the round overhead and each round row's error when
    the overhead is fitted without it (leave-one-out), its stages priced by their fits."""
    out = {}
    for kind, decode in (("speculative", False), ("decode", True)):
        fitted = fits.round_overhead(decode=decode)
        if fitted is None:
            continue
        rows, errs = fits.round_rows(decode), []
        for i, mm in enumerate(rows):
            rest = (fits.round_overhead(rows=rows[:i] + rows[i + 1:]) if len(rows) > 1
                    else None)
            if rest is not None:
                ms = fits.round_stages_ms(mm) + rest.seconds(mm.batch) * 1e3
                errs.append(abs(ms / mm.ms - 1) * 100)
        med, mx = _stats(errs)
        out[kind] = {"fixed_ms": fitted.fixed_ms, "per_seq_ms": fitted.per_seq_ms,
                     "rows": fitted.rows, "median_pct": med, "max_pct": mx}
    return out or None


def _overlap(fits: ProfileFits) -> dict | None:
    """The contention fitted to the overlap rows (always leave-one-out: one lam per side)."""
    fitted = fits.contention()
    if not fitted.fitted:
        return None
    med, mx = _stats(fitted.held_out_pct)
    return {"law": fitted.law, "serial": dict(fitted.serial), "how": dict(fitted.how),
            "ratio": {s: [r.a, r.b] for s, r in fitted.ratio.items()},
            "law_held_out_pct": dict(fitted.law_held_out), "rows": fitted.rows,
            "median_pct": med, "max_pct": mx,
            "per_side": {k: [len(errs), *_stats(errs)] for k, errs in fitted.held_out_by.items()}}


def _without_mixed_fit(fits: ProfileFits, device: str) -> StageReport:
    """The error of pricing `device`'s mixed rows as the simulator does without a mixed fit
    (ProfileCost's fallback: see the module docstring)."""
    cost = ProfileCost(fits.profile, fits=fits, device=device, stages=WITHOUT_MIXED)
    rows, errs = fits.profile.rows("mixed", device), []
    for mm in rows:
        stage = "decode" if mm.tokens_per_seq == 1 else "verify"
        if cost.has(stage):
            ms = cost.mixed_seconds(stage, mm.batch, mm.tokens_per_seq, mm.context,
                                    Chunk(*mm.chunk)) * 1e3
            errs.append(abs(ms / mm.ms - 1) * 100)
    med, mx = _stats(errs)
    rule = "step + chunks" if cost.per_chunk else "marginal rule"
    return StageReport(f"mixed ({rule})", device, len(rows), len(errs), None, None, med, mx)


def write_fit_report(profile: Profile, profile_path: str | Path,
                     every: int | None = None) -> FitReport:
    """Write NAME.fit.txt (the table) and NAME.fit.json beside the profile NAME.json."""
    path = Path(profile_path)
    report = fit_report(profile, path.name, every)
    path.with_suffix(".fit.txt").write_text(report.table() + "\n")
    path.with_suffix(".fit.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    """python -m kestrel_sim.costs.report PROFILE.json [--every K] [--write]: print the fit
    report of a profile; --write also writes NAME.fit.txt and NAME.fit.json beside it."""
    import argparse

    from kestrel_sim.errors import KestrelError

    parser = argparse.ArgumentParser(prog="python -m kestrel_sim.costs.report",
                                     description=main.__doc__)
    parser.add_argument("profile")
    parser.add_argument("--every", type=int, default=None,
                        help="hold out every K-th row of each stage (default: leave-one-out)")
    parser.add_argument("--write", action="store_true", help="write the report beside it")
    args = parser.parse_args(argv)
    try:
        profile = Profile.load(args.profile)
        report = (write_fit_report(profile, args.profile, args.every) if args.write
                  else fit_report(profile, Path(args.profile).name, args.every))
    except KestrelError as err:
        print(f"error: {err}")
        return 2
    print(report.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
