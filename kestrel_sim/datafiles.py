"""Data files a scenario names: numbers (empirical lengths, acceptance traces) and replayed
arrivals. Read at validation (so a bad file is an error at its YAML key and line) and again
when the workload is drawn."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from kestrel_sim.errors import ConfigError


def read_numbers(path: str | Path, what: str) -> np.ndarray:
    """Numbers in a file: a JSON list, or values separated by commas/whitespace/newlines
    with `#` comments."""
    text = Path(path).read_text()
    try:
        if text.lstrip().startswith("["):
            values = json.loads(text)
        else:
            values = [
                float(tok)
                for line in text.splitlines()
                for tok in line.split("#", 1)[0].replace(",", " ").split()
            ]
    except (ValueError, json.JSONDecodeError) as err:
        raise ConfigError(f"{what} file {path}: expected numbers ({err})") from None
    if not values:
        raise ConfigError(f"{what} file {path} holds no numbers")
    return np.asarray(values, dtype=float)


def read_replay(path: str) -> dict[str, np.ndarray]:
    """Columns of a replay file: 'arrival' always, 'prompt_tokens'/'output_tokens' if given."""
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip() and ln[0] != "#"]
    if not lines:
        raise ConfigError(f"arrival trace {path} is empty")
    first = lines[0].replace(",", " ").split()
    try:
        float(first[0])
    except ValueError:
        rows = list(csv.DictReader(lines))
        names = {n.strip().lower(): n for n in rows[0]} if rows else {}
        time_col = next((names[n] for n in ("arrival", "timestamp", "time") if n in names), None)
        if time_col is None:
            raise ConfigError(
                f"arrival trace {path}: the header needs an 'arrival' (or 'timestamp') "
                f"column, found {', '.join(names) or 'nothing'}"
            ) from None
        out = {}
        try:
            out["arrival"] = np.array([float(r[time_col]) for r in rows])
            for key, alts in (("prompt_tokens", ("prompt_tokens", "input_tokens")),
                              ("output_tokens", ("output_tokens",))):
                col = next((names[a] for a in alts if a in names), None)
                if col is not None:
                    out[key] = np.array([int(float(r[col])) for r in rows], dtype=np.int64)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"arrival trace {path}: a value is not a number ({err})") from None
        return out
    return {"arrival": read_numbers(path, "arrival trace")}
