"""Where and how a calibration ran: the device, the software, the code and the model.

    env = environment(torch.device("cuda"))   # device, driver, CUDA, torch, cupy versions
    commit = git_commit()                      # "3f2a...", "3f2a...-dirty" or "unknown"

Each field is read from its source and left None where the source is missing (no
nvidia-smi, no cupy, not a git checkout); nothing here fails a calibration.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path | None = None) -> str | None:
    """A command's stripped stdout, or None when it cannot run or fails."""
    try:
        done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def git_commit(repo: Path = REPO) -> str:
    """The checkout's commit, with "-dirty" when tracked files differ from it; "unknown"
    outside a git checkout."""
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    if commit is None:
        return "unknown"
    changed = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    return f"{commit}-dirty" if changed else commit


def driver_version(device) -> str | None:
    """The NVIDIA driver (nvidia-smi), else the CUDA driver API version torch reports."""
    found = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if found:
        return found.splitlines()[0].strip()
    try:
        import torch

        version = torch._C._cuda_getDriverVersion()  # e.g. 12080: the driver's CUDA API
    except (AttributeError, RuntimeError, ImportError):
        return None
    return f"CUDA driver API {version // 1000}.{version % 1000 // 10}" if version else None


def cupy_version() -> str | None:
    try:
        import cupy
    except ImportError:
        return None
    return cupy.__version__


def host_cpu() -> str:
    """The host's CPU model ("Intel(R) Xeon(R) Platinum 8480+"), as /proc/cpuinfo names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_threads() -> int | None:
    """The CPU threads torch runs a CPU forward on (a CPU draft's step time scales with
    them: the same CPU model measured 20-140% apart in two sessions)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.get_num_threads()


def environment(device) -> dict:
    """The device and software versions of a run with its target on `device` (a
    torch.device): the Fingerprint's fields of that name."""
    import torch

    gpu = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if gpu else host_cpu(),
        "host_cpu": host_cpu(),
        "host_threads": host_threads(),
        "driver": driver_version(device) if gpu else None,
        "cuda": torch.version.cuda if gpu else None,
        "torch": torch.__version__,
        "cupy": cupy_version(),
    }
