"""Where a run's workers go on this machine: serving.devices (or the machine's GPUs), dealt
round-robin by kestrel_sim.placement, checked against the devices the machine has.

    where = placement(sc.serving, torch.device("cuda"), gpus=torch.cuda.device_count())
    # two GPUs, disaggregated 1 + 1: {"prefill0": cuda:0, "decode0": cuda:1}

Without serving.devices the list is the run's device: `cuda` (no index) every GPU of the
machine in turn, `cuda:N` that GPU, `cpu` the CPU; so one GPU (or the CPU) holds every
worker, each on its own stream, as before there were several. A name the machine lacks, or
a CPU named for a GPU run (or the reverse), is refused naming serving.devices.
"""

from __future__ import annotations

import torch

from kestrel_sim.errors import KestrelError
from kestrel_sim.placement import place, worker_prefixes
from kestrel_sim.serving_spec import Serving


class PlacementError(KestrelError):
    """serving.devices names devices this run cannot use."""


def machine_devices(device: torch.device, gpus: int) -> list[str]:
    """The default device list for a run on `device` on a machine of `gpus` GPUs."""
    if device.type != "cuda":
        return [str(device)]
    if device.index is not None:
        return [f"cuda:{device.index}"]
    return [f"cuda:{i}" for i in range(max(gpus, 1))]


def check_devices(devices: list[str], device: torch.device, gpus: int) -> None:
    """Refuse serving.devices entries of another kind than the run's device, or GPUs the
    machine does not have."""
    kind = device.type
    other = [d for d in devices if torch.device(d).type != kind]
    if other:
        raise PlacementError(
            f"serving.devices names {other[0]} but this run is on the {kind} (the scenario's "
            f"hardware): name {'GPUs (cuda:N)' if kind == 'cuda' else 'cpu'} in "
            "serving.devices, or leave it out")
    missing = sorted({d for d in devices if kind == "cuda" and torch.device(d).index >= gpus})
    if missing:
        have = f"cuda:0..cuda:{gpus - 1}" if gpus > 1 else "cuda:0" if gpus else "none"
        raise PlacementError(
            f"serving.devices names {', '.join(missing)} but this machine has {gpus} GPU"
            f"{'s' if gpus != 1 else ''} ({have}): name GPUs it has, or run the scenario on "
            "the simulator (--on sim)")


def placement(serving: Serving, device: torch.device, gpus: int) -> dict[str, torch.device]:
    """Each worker's device (worker prefix -> torch device), in placement order."""
    devices = serving.devices
    if devices is None:
        devices = machine_devices(device, gpus)
    else:
        check_devices(devices, device, gpus)
    return {name: torch.device(d) for name, d in place(worker_prefixes(serving), devices).items()}
