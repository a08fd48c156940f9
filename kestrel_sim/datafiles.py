"""Data files a scenario names: numbers (empirical lengths, acceptance traces) and replayed
arrivals. Read at validation (so a bad file is an error at its YAML key and line, naming
the line within the file) and again when the workload is drawn.

A numbers file is a JSON list, or values separated by commas, whitespace or newlines with
`#` comments. A replay file is a CSV with a header, or a plain list of times.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from kestrel_sim.errors import ConfigError


def read_text(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{what} file {path} is not a text file") from None
    except OSError as err:
        raise ConfigError(f"cannot read {what} file {path}: {err.strerror or err}") from None


def _number(token, path, line: int, what: str) -> float:
    """`token` (text or a JSON value) as a finite float, or an error naming the line."""
    if isinstance(token, bool) or not isinstance(token, (str, int, float)):
        raise ConfigError(f"{what} file {path}:{line}: expected a number, got {json.dumps(token)}")
    try:
        value = float(token)
    except ValueError:
        raise ConfigError(f"{what} file {path}:{line}: '{token}' is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{what} file {path}:{line}: '{token}' is not a finite number")
    return value


def _json_list(text: str, path, what: str) -> tuple[list[float], list[int]]:
    """A JSON list of numbers, element by element, so each value keeps its line."""
    decoder = json.JSONDecoder()
    values: list[float] = []
    lines: list[int] = []
    pos = text.index("[") + 1
    try:
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if text.startswith("]", pos) and not values:
                break
            line = text.count("\n", 0, pos) + 1
            item, pos = decoder.raw_decode(text, pos)
            values.append(_number(item, path, line, what))
            lines.append(line)
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if text.startswith(",", pos):
                pos += 1
            elif text.startswith("]", pos):
                break
            else:
                raise json.JSONDecodeError("expected ',' or ']'", text, pos)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{what} file {path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if text[pos + 1:].strip():
        line = text.count("\n", 0, pos) + 1
        raise ConfigError(f"{what} file {path}:{line}: unexpected text after the JSON list")
    return values, lines


def read_numbered(path: str | Path, what: str) -> tuple[np.ndarray, np.ndarray]:
    """([n] values, [n] the line of each value) of a numbers file."""
    text = read_text(path, what)
    if text.lstrip().startswith("["):
        values, lines = _json_list(text, path, what)
    else:
        values, lines = [], []
        for line, row in enumerate(text.splitlines(), start=1):
            for token in row.split("#", 1)[0].replace(",", " ").split():
                values.append(_number(token, path, line, what))
                lines.append(line)
    if not values:
        raise ConfigError(f"{what} file {path} holds no numbers")
    return np.asarray(values, dtype=float), np.asarray(lines, dtype=np.int64)


def read_numbers(path: str | Path, what: str) -> np.ndarray:
    """[n] the numbers in a numbers file."""
    return read_numbered(path, what)[0]


def read_counts(path: str | Path, what: str, low: int, high: int | None = None,
                high_hint: str = "") -> np.ndarray:
    """[n] whole numbers in [low, high] from a numbers file; the first value outside names
    its line. `high_hint` is appended to the message about a value above `high`."""
    values, lines = read_numbered(path, what)
    for bad, expected in ((values != np.rint(values), "is not a whole number"),
                          (values < low, f"is below {low}"),
                          (values > (np.inf if high is None else high), f"is above {high}")):
        if bad.any():
            i = int(np.argmax(bad))
            hint = high_hint if expected.startswith("is above") else ""
            raise ConfigError(f"{what} file {path}:{lines[i]}: {values[i]:g} {expected}{hint}")
    return values.astype(np.int64)


TIME_COLUMNS = ("arrival", "timestamp", "time")
TOKEN_COLUMNS = {"prompt_tokens": ("prompt_tokens", "input_tokens"),
                 "output_tokens": ("output_tokens",)}


def read_replay(path: str | Path) -> dict[str, np.ndarray]:
    """Columns of a replay file: 'arrival' always (seconds or ms as given), and
    'prompt_tokens' / 'output_tokens' (whole numbers >= 1) where the CSV has them."""
    what = "arrival trace"
    rows = [(n, text) for n, text in enumerate(read_text(path, what).splitlines(), start=1)
            if text.strip() and not text.lstrip().startswith("#")]
    if not rows:
        raise ConfigError(f"{what} file {path} is empty")
    first = rows[0][1].replace(",", " ").split()[0]
    try:
        float(first)
    except ValueError:
        return _read_csv(path, rows)
    return {"arrival": read_numbers(path, what)}


def _read_csv(path, rows: list[tuple[int, str]]) -> dict[str, np.ndarray]:
    what = "arrival trace"
    header_line, header = rows[0]
    names = [n.strip().lower() for n in next(csv.reader([header]))]
    time_col = next((names.index(n) for n in TIME_COLUMNS if n in names), None)
    if time_col is None:
        raise ConfigError(
            f"{what} file {path}:{header_line}: the header needs an 'arrival' (or 'timestamp') "
            f"column, found {', '.join(names) or 'nothing'}")
    columns = {"arrival": time_col}
    for key, alts in TOKEN_COLUMNS.items():
        col = next((names.index(a) for a in alts if a in names), None)
        if col is not None:
            columns[key] = col
    out: dict[str, list[float]] = {key: [] for key in columns}
    for line, cells in zip((n for n, _ in rows[1:]), csv.reader(t for _, t in rows[1:])):
        if len(cells) != len(names):
            raise ConfigError(f"{what} file {path}:{line}: {len(cells)} values, but the "
                              f"header names {len(names)} columns")
        for key, col in columns.items():
            value = _number(cells[col].strip(), path, line, what)
            if key != "arrival" and (value != round(value) or value < 1):
                raise ConfigError(f"{what} file {path}:{line}: {names[col]} is "
                                  f"{cells[col].strip()}, expected a whole number >= 1")
            out[key].append(value)
    if not out["arrival"]:
        raise ConfigError(f"{what} file {path} has a header but no rows")
    return {key: np.asarray(v, dtype=float if key == "arrival" else np.int64)
            for key, v in out.items()}
