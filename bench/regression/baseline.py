"""Saved baselines of the regression gates, and the rule that judges a new measurement.

    baselines/sim_speed.json   ratios to the reference workload (machine-independent)
    baselines/gpu_h200.json    milliseconds on one NVIDIA H200 (filled on that GPU)

A gate passes while value <= baseline x (1 + margin): lower is better for every gate (a
ratio of times, or a time). KESTREL_UPDATE_BASELINES=1 makes the gate tests record what
they measure instead of judging it (with the date, host and commit), for a deliberate
change of speed or a first recording on new hardware.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "baselines"
UPDATE_ENV = "KESTREL_UPDATE_BASELINES"


def updating() -> bool:
    return os.environ.get(UPDATE_ENV, "") not in ("", "0")


def load(name: str) -> dict:
    return json.loads((FOLDER / f"{name}.json").read_text())


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=FOLDER,
                              capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def record(name: str, gate: str, value: float, where: dict | None = None) -> None:
    """Write `value` as gate's baseline in baselines/NAME.json (read, change, replace)."""
    path = FOLDER / f"{name}.json"
    doc = json.loads(path.read_text())
    doc["baselines"][gate] = value
    doc["recorded"] = {"date": datetime.date.today().isoformat(), "host": platform.node(),
                       "python": platform.python_version(), "commit": commit(),
                       **(where or {})}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def judge(value: float, baseline: float, margin: float) -> tuple[bool, str]:
    """(passes, a line saying by how much)."""
    limit = baseline * (1 + margin)
    change = (value / baseline - 1) * 100
    return value <= limit, (f"{value:.4g} against baseline {baseline:.4g} ({change:+.1f}%; "
                            f"fails past +{margin * 100:g}%, {limit:.4g})")
