"""Putting profiles together: parts of one grid measured apart, or rows measured again.

    whole = merged(a, b)            # both sets of rows (e.g. grid parts of several workers)
    fresh = with_rows_of(base, b)   # base's rows of each (stage, device) b measured, b's

Both refuse profiles of different setups with a ConfigError naming each field that differs
and both values; both keep the first profile's fingerprint and record the other's in
`parts` (Profile.merge and Profile.replace_rows call them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kestrel_sim.errors import ConfigError
from kestrel_sim.measured_acceptance import combine

if TYPE_CHECKING:
    from kestrel_sim.profile import Fingerprint, Profile

# fingerprint fields two profiles must share for one to replace the other's rows, to be
# merged (where the draft ran and the options too), and those a flag lets differ in a merge
SAME_MODELS = ("device", "model", "model_shape_hash", "dtype", "quant", "draft_model",
               "draft_shape_hash", "draft_quant", "backend")
SAME_SETUP = SAME_MODELS + ("draft_device", "options")
VERSIONS = ("git_commit", "driver", "cuda", "torch", "cupy")


def merged(a: Profile, b: Profile, allow_version_drift: bool = False) -> Profile:
    """One profile holding both sets of measurements. Refused when the setups differ
    (device, model and its shape, dtype, quant, draft, backend, options; the host CPU where
    CPU rows are involved); a different commit or software version (driver, CUDA, torch,
    cupy) only with allow_version_drift. Dates may differ: parts of one grid measured apart
    always do, and the code and software, checked above, are what change the timings. The
    result keeps a's fingerprint; `parts` lists b's where its date, grid or versions
    differ."""
    cpu_rows = any(m.device == "cpu" for m in a.measurements + b.measurements)
    refuse_other_setup(a, b, SAME_SETUP, cpu_rows, "merge profiles")
    fa, fb = a.fingerprint, b.fingerprint
    drift = [f for f in VERSIONS if getattr(fa, f) != getattr(fb, f)]
    if drift and not allow_version_drift:
        raise ConfigError(f"the profiles were measured by different runs "
                          f"({differences(fa, fb, drift)}); merge them with "
                          "allow_version_drift=True if that is intended")
    differs = drift or fa.grid != fb.grid or fa.date != fb.date
    parts = list(a.parts) + ([fb] if differs else []) + list(b.parts)
    try:
        acceptance = combine(a.acceptance, b.acceptance)
    except ValueError as err:
        raise ConfigError(f"cannot merge profiles: {err}") from None
    return type(a)(fingerprint=fa.model_copy(update={"grid": both_grids(fa, fb)}),
                   runtime=a.runtime, measurements=list(a.measurements) + list(b.measurements),
                   acceptance=acceptance, parts=parts)


def with_rows_of(base: Profile, b: Profile) -> Profile:
    """`base` with its rows of each (stage, device) pair that `b` measured replaced by b's
    (e.g. the CPU draft's steps measured again). The setups must match as for merged(),
    except where the draft ran, the options and the versions: `parts` records b's
    fingerprint, and b's benches join the options. The acceptance stays base's (b's where
    base has none)."""
    pairs = {(m.stage, m.device) for m in b.measurements}
    cpu_rows = any(device == "cpu" for _, device in pairs)
    refuse_other_setup(base, b, SAME_MODELS, cpu_rows, "replace rows between profiles")
    fa, fb = base.fingerprint, b.fingerprint
    kept = [m for m in base.measurements if (m.stage, m.device) not in pairs]
    fingerprint = fa.model_copy(update={"grid": both_grids(fa, fb),
                                        "options": {**fa.options, **fb.options}})
    return type(base)(fingerprint=fingerprint, runtime=base.runtime,
                      measurements=kept + list(b.measurements),
                      acceptance=base.acceptance or b.acceptance,
                      parts=list(base.parts) + [fb] + list(b.parts))


def refuse_other_setup(a: Profile, b: Profile, fields: tuple[str, ...], cpu_rows: bool,
                       action: str) -> None:
    """A ConfigError naming each of `fields` whose values differ (and the host CPU where
    CPU rows are involved), or the runtimes where they ran steps differently."""
    fa, fb = a.fingerprint, b.fingerprint
    differ = [f for f in fields if getattr(fa, f) != getattr(fb, f)]
    if cpu_rows and fa.host_cpu != fb.host_cpu:
        differ.append("host_cpu")
    if differ:
        raise ConfigError(f"cannot {action} of different setups "
                          f"({differences(fa, fb, differ)}): measure both with the "
                          "same device, model, dtype, quant and draft")
    if a.runtime != b.runtime:
        raise ConfigError(f"cannot {action} whose runtimes ran steps differently "
                          f"(runtime: {a.runtime} vs {b.runtime}): step graphs "
                          "and prompt chunks must be the same")


def differences(a: Fingerprint, b: Fingerprint, fields: list[str]) -> str:
    return "; ".join(f"{f}: {getattr(a, f)!r} vs {getattr(b, f)!r}" for f in fields)


def both_grids(a: Fingerprint, b: Fingerprint) -> str | None:
    return a.grid if a.grid == b.grid else "+".join(g for g in (a.grid, b.grid) if g) or None
