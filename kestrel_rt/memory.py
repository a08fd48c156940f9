"""Will a model fit? Bytes of its weights and KV cache against the device's free memory.

Checked before a long load, so a model too large for the machine is a clear error rather than
a process killed halfway by the kernel's out-of-memory killer (CPU) or a CUDA OOM traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kestrel_rt.weights import parse_dtype, weight_bytes
from kestrel_sim.errors import KestrelError
from kestrel_sim.models import ModelShape

if TYPE_CHECKING:
    import torch


def kv_bytes(shape: ModelShape, dtype: str | torch.dtype, tokens: int) -> int:
    """Bytes of a KV cache holding `tokens` tokens (over all slots) in `dtype`."""
    return parse_dtype(dtype).itemsize * shape.kv_elements_per_token * tokens


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`: the GPU's free memory on CUDA (after handing
    back what an earlier run left cached: `reclaim`), the host's MemAvailable (Linux
    /proc/meminfo) on the CPU; None where it cannot be told."""
    import torch

    if device.type == "cuda":
        reclaim(device)
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def reclaim(device: torch.device) -> None:
    """Hand the GPU memory of objects no longer used back to the device: collect reference
    cycles (a model and its CUDA graphs hold each other), then empty torch's caching
    allocator and cupy's memory pools. Without it, a second run in the same process (the
    scenarios of `kestrel validate`) saw the first run's caches as taken: 39 GB free of 141."""
    import gc
    import sys

    import torch

    gc.collect()
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")  # only if this process uses it
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def check_fits(
    shape: ModelShape, dtype: str | torch.dtype, device: torch.device, free: int | None,
    kv_tokens: int = 0,
) -> None:
    """Refuse a model whose weights plus a KV cache of `kv_tokens` tokens, in `dtype`, need
    more than the `free` bytes of `device` (None: unknown, nothing refused)."""
    weights, cache = weight_bytes(shape, dtype), kv_bytes(shape, dtype, kv_tokens)
    if free is not None and weights + cache > free:
        name = str(parse_dtype(dtype)).removeprefix("torch.")
        raise KestrelError(
            f"model '{shape.name}' needs {_size(weights + cache)} in {name} ({_size(weights)} "
            f"of weights, {_size(cache)} of KV cache for {kv_tokens} tokens), but {device} "
            f"has {_size(free)} free; expected a smaller model or --max-new-tokens, a "
            "smaller --dtype (bfloat16), or a device with more memory"
        )
