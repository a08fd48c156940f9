"""The safetensors files of a model folder and their headers (names, shapes, dtypes).

Read by the float loader (kestrel_rt/loading.py) and the AWQ loader (kestrel_rt/awq.py)
alike, before any tensor data: a bad checkpoint fails fast and says which file is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

from kestrel_sim.errors import KestrelError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(KestrelError):
    """A model folder or safetensors file that cannot be loaded as it is."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file or index that does not parse (truncated, bad header, bad JSON)."""


class MissingShardError(CheckpointError):
    """No weights file, or an index naming a shard that is not in the folder."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of `folder`: the index's shards, model.safetensors, or all."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CorruptCheckpointError(
                f"{index} is not a safetensors index: expected JSON with a 'weight_map' object "
                "mapping tensor names to shard file names"
            ) from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise MissingShardError(
                f"{index} names shard(s) {', '.join(missing)} that are not in {folder}; "
                f"expected all {len(shards)} shards next to the index (an incomplete download?)"
            )
        return [folder / s for s in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise MissingShardError(
            f"{folder} has no weights: expected {SINGLE_FILE}, or shards listed in {INDEX_FILE}"
        )
    return found


def read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, safetensors dtype) for every tensor, from the headers only."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    info = f.get_slice(name)
                    if name in found:
                        raise CorruptCheckpointError(
                            f"tensor '{name}' is in both {found[name][0]} and {path}; "
                            "expected each tensor in exactly one file"
                        )
                    found[name] = (path, tuple(info.get_shape()), info.get_dtype())
        except (SafetensorError, OSError) as err:
            raise CorruptCheckpointError(
                f"{path} is not a readable safetensors file ({err}); it may be truncated or "
                "corrupt: expected an 8-byte header length, a JSON header and all tensor bytes"
            ) from None
    return found
