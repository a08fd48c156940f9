"""Worker placement: which device each serving worker runs on (serving.devices).

    place(worker_prefixes(sc.serving), ["cuda:0", "cuda:1"])
    # {"prefill0": "cuda:0", "decode0": "cuda:1"}

Workers are named as the simulator names them (gpu0, gpu1, ... colocated; prefill0, ...
then decode0, ... disaggregated) and dealt round-robin over the device list, in that order:
worker i runs on devices[i mod len(devices)]. A list with one entry per worker is an
explicit placement; a repeated entry puts two workers on one device. Pure (no torch): the
runtime (kestrel_rt/serve/placement.py) checks the names against the machine's devices.
"""

from __future__ import annotations

from kestrel_sim.serving_spec import Serving


def worker_prefixes(serving: Serving) -> list[str]:
    """The workers' names, in placement order (their spans' worker is PREFIX/target)."""
    if serving.mode == "colocated":
        return [f"gpu{i}" for i in range(serving.workers)]
    return ([f"prefill{i}" for i in range(serving.prefill_workers)]
            + [f"decode{i}" for i in range(serving.decode_workers)])


def place(prefixes: list[str], devices: list[str]) -> dict[str, str]:
    """Each worker's device: the i-th worker on devices[i mod len(devices)]."""
    if not devices:
        raise ValueError("no device to place the workers on")
    return {name: devices[i % len(devices)] for i, name in enumerate(prefixes)}


def placement(serving: Serving) -> dict[str, str] | None:
    """serving.devices dealt to the workers (place), or None without a device list (the
    simulator's default: a device per worker)."""
    return place(worker_prefixes(serving), serving.devices) if serving.devices else None
