"""Building blocks of every scenario part: a strict pydantic base model, and file paths
taken from the scenario file's folder (the validation context's `base_dir`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationInfo


class StrictModel(BaseModel):
    """A configuration model: an unknown key is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")


def in_base_dir(value: str | Path, info: ValidationInfo) -> Path:
    """`value` as a path; a relative one is taken from the validation context's base_dir
    (the scenario file's folder)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path((info.context or {}).get("base_dir", ".")) / path


def resolve_file(value: str | Path, info: ValidationInfo, what: str) -> str:
    """`value` made absolute against the context's base_dir; an error if it does not exist."""
    path = in_base_dir(value, info)
    if not path.is_file():
        looked = path.resolve()
        problem = "is a folder, not a file" if path.is_dir() else "not found"
        raise ValueError(f"{what} file '{value}' {problem} (looked for {looked})")
    return str(path.resolve())
