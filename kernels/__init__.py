"""CUDA C sources (`*.cu`), compiled at run time by cupy. One concern per file."""

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent


def source(name: str) -> str:
    """The text of kernels/NAME.cu."""
    return (KERNEL_DIR / f"{name}.cu").read_text()
