"""Measured runs kept to predict again against (`kestrel validate --measured SOURCE`).

    kept = load_kept(Path("bench/results/validation/measured.json"))   # or an OUT folder
    kept["spec-off"].metrics                   # what the runtime measured (Metrics JSON)

A run on both sides writes OUT/NAME/hardware/metrics.json, hardware/scenario.json and
comparison.json (the machine's fingerprint). `kestrel validate` also gathers them, for every
scenario of OUT, into one file, OUT/measured.json (write_bundle), which is what a repository
keeps of a suite's measurement (bench/results/validation/). SOURCE is either.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kestrel_sim.errors import ConfigError

BUNDLE = "measured.json"
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
            doc = json.loads(source.read_text())
            return {name: Kept(**entry) for name, entry in doc["scenarios"].items()}
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"--measured {source}: not a bundle of kept measurements "
                              f"({BUNDLE} as kestrel validate writes it): {err}") from None
    if source.is_dir():
        found = {p.name: from_folder(p) for p in sorted(source.iterdir()) if p.is_dir()}
        return {name: kept for name, kept in found.items() if kept is not None}
    raise ConfigError(f"--measured {source}: neither a folder (an earlier --on both output) "
                      f"nor a {BUNDLE} file")


def kept_run(source: Path, name: str) -> Kept | None:
    """Scenario `name`'s kept measurement in `source`: an OUT folder of one run on both
    sides (OUT/hardware, OUT/comparison.json), a suite's OUT folder, or a bundle file."""
    if source.is_dir():
        own = from_folder(source)
        if own is not None:
            return own
    return load_kept(source).get(name)


def write_bundle(out: Path, names: list[str]) -> bool:
    """OUT/measured.json: every scenario of `names` whose folder holds a measurement
    (compact JSON, written whole); False where none does (no file)."""
    kept = {n: from_folder(out / n) for n in names}
    kept = {n: asdict(k) for n, k in kept.items() if k is not None}
    if not kept:
        return False
    tmp = out / f".{BUNDLE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"scenarios": kept}, separators=(",", ":")) + "\n")
    tmp.replace(out / BUNDLE)
    return True
