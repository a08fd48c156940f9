"""Measured runs kept to predict again against (`kestrel validate --measured SOURCE`).

    kept = load_kept(Path("bench/results/validation/measured.json.gz"))   # or an OUT folder
    kept["spec-off"].metrics                   # what the runtime measured (Metrics JSON)

A run on both sides writes OUT/NAME/hardware/metrics.json, hardware/scenario.json and
comparison.json (the machine's fingerprint). `kestrel validate` also gathers them, for every
scenario of OUT, into one gzipped file, OUT/measured.json.gz (write_bundle), which is what a
repository keeps of a suite's measurement (bench/results/validation/; each run's per-token
latencies make it megabytes of JSON, a tenth of that compressed). SOURCE is either; a plain
JSON bundle reads too. `kept_run` finds one scenario's run in a SOURCE by its name or, for
variants of one scenario (--set), by the scenario it ran.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kestrel_sim.errors import ConfigError

BUNDLE = "measured.json.gz"
NOT_RUN = ("costs", "validate")  # scenario keys the runtime does not read
FILES = {"metrics": "hardware/metrics.json", "scenario": "hardware/scenario.json",
         "comparison": "comparison.json"}


@dataclass
class Kept:
    """One scenario's measurement: its metrics, the scenario as run, its comparison."""

    metrics: dict
    scenario: dict
    comparison: dict


def from_folder(folder: Path) -> Kept | None:
    """The measurement an OUT/NAME folder of a run on both sides holds, or None."""
    if not all((folder / f).is_file() for f in FILES.values()):
        return None
    return Kept(**{k: json.loads((folder / f).read_text()) for k, f in FILES.items()})


def load_kept(source: Path) -> dict[str, Kept]:
    """Scenario name -> its kept measurement, from a bundle file or an OUT folder."""
    if source.is_file():
        try:
            data = source.read_bytes()
            doc = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
            return {name: Kept(**entry) for name, entry in doc["scenarios"].items()}
        except (ValueError, KeyError, TypeError, OSError) as err:
            raise ConfigError(f"--measured {source}: not a bundle of kept measurements "
                              f"({BUNDLE} as kestrel validate writes it): {err}") from None
    if source.is_dir():
        found = {p.name: from_folder(p) for p in sorted(source.iterdir()) if p.is_dir()}
        return {name: kept for name, kept in found.items() if kept is not None}
    raise ConfigError(f"--measured {source}: neither a folder (an earlier --on both output) "
                      f"nor a {BUNDLE} file")


def differing(ran: dict, now: dict) -> list[str]:
    """The scenario keys the runtime reads whose values differ between two scenarios."""
    ran, now = as_run(ran), as_run(now)
    return sorted(k for k in set(ran) | set(now) if k not in NOT_RUN and ran.get(k) != now.get(k))


def as_run(scenario: dict) -> dict:
    """The scenario as the runtime reads it: an organic acceptance (spec.acceptance.
    on_hardware: organic) without its rates, which only the simulator draws from."""
    acc = (scenario.get("spec") or {}).get("acceptance") or {}
    if acc.get("on_hardware") != "organic":
        return scenario
    spec = {**scenario["spec"], "acceptance": {"on_hardware": "organic"}}
    return {**scenario, "spec": spec}


def kept_run(source: Path, scenario: dict) -> Kept | None:
    """The kept measurement of `scenario` (as dumped) in `source`: an OUT folder of one run
    on both sides, a suite's OUT folder or a bundle file. By name, unless another entry ran
    the scenario as it is now (a bundle of --set variants of one scenario, keyed by label);
    None where none is named so."""
    if source.is_dir():
        own = from_folder(source)
        if own is not None:
            return own
    kept = load_kept(source)
    named = kept.get(scenario["name"])
    if named is not None and not differing(named.scenario, scenario):
        return named
    same = [k for k in kept.values() if not differing(k.scenario, scenario)]
    return same[0] if same else named


def write_bundle(out: Path, names: list[str]) -> bool:
    """OUT/measured.json.gz: every scenario of `names` whose folder holds a measurement
    (compact JSON, gzipped, written whole); False where none does (no file)."""
    kept = {n: from_folder(out / n) for n in names}
    kept = {n: asdict(k) for n, k in kept.items() if k is not None}
    if not kept:
        return False
    tmp = out / f".{BUNDLE}.{os.getpid()}.tmp"
    text = json.dumps({"scenarios": kept}, separators=(",", ":")) + "\n"
    tmp.write_bytes(gzip.compress(text.encode(), mtime=0))
    tmp.replace(out / BUNDLE)
    return True
