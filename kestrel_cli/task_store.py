"""A folder of finished tasks' results, one JSON file each, named by the task's key.

A command whose work splits into independent tasks (a sweep's grid points, a calibration's
measurements) saves each result here as it arrives, so an interrupted run loses nothing and a
rerun reads back what is done instead of recomputing it. A key is a hash of the task's whole
input and of the code that computes it (`content_key`, `source_digest`), so a result is reused
only for exactly the same input run by exactly the same code.

    store = TaskStore(out / "points")
    done = store.results(keys)           # key -> result, for the keys already saved
    store.save(key, result, label)       # written whole (a temporary file renamed into place)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

KEY_CHARS = frozenset("0123456789abcdef")
SOURCE_SUFFIXES = frozenset({".py", ".yaml", ".json", ".cu", ".cuh"})  # code and package data


def content_key(text: str, code: str = "") -> str:
    """The key of a task whose whole input is `text` (a scenario's JSON, say), computed by the
    code whose `source_digest` is `code`: 16 hex digits."""
    return hashlib.sha256(f"{code}\n{text}".encode()).hexdigest()[:16]


def source_digest(packages: tuple[str, ...]) -> str:
    """A hash of the installed source of `packages` (code and package data), to tell results
    of other code apart, and to check that Ray's workers run the same code as this process."""
    digest = hashlib.sha256()
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            digest.update(f"{package}: not installed".encode())
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                digest.update(path.relative_to(root).as_posix().encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class TaskStore:
    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, key: str) -> Path:
        assert key and set(key) <= KEY_CHARS, f"a task key is hex digits, not {key!r}"
        return self.folder / f"{key}.json"

    def keys(self) -> set[str]:
        """The keys of every result saved here (none when the folder does not exist)."""
        if not self.folder.is_dir():
            return set()
        return {p.stem for p in self.folder.glob("*.json") if set(p.stem) <= KEY_CHARS}

    def results(self, keys) -> dict[str, Any]:
        """key -> saved result for each of `keys` that is saved and readable; a file that
        cannot be read back (edited by hand, say) counts as not saved and is recomputed."""
        found = {}
        for key in self.keys() & set(keys):
            try:
                found[key] = json.loads(self.path(key).read_text())["result"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    def save(self, key: str, result: Any, label: str = "") -> None:
        """Write one result (JSON-able); `label` names the task for a reader of the file."""
        path = self.path(key)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"key": key, "task": label, "result": result}))
        os.replace(temporary, path)
