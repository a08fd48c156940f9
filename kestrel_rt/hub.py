"""Hugging Face hub ids (`Qwen/Qwen3-8B`) as vLLM and transformers take them, from the local
cache only: Kestrel never downloads, so a hub id that is not cached is an error that says how
to fetch it.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, no path separators else


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name))


def cached_folder(name: str) -> Path | None:
    """The local Hugging Face cache's snapshot folder of hub id `name`, or None when `name`
    is not a hub id or is not cached (huggingface_hub's cache, $HF_HUB_CACHE; offline)."""
    if not is_hub_id(name):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 (not cached, a bad id, or no huggingface_hub: not found)
        return None


def fetch_hint(name: str) -> str:
    """What to say when `name`, a missing folder, looks like a hub id; else ''."""
    if not is_hub_id(name):
        return ""
    return (f"; '{name}' is not in the local Hugging Face cache either, and Kestrel never "
            f"downloads: fetch it first (hf download {name}) or pass its folder")
