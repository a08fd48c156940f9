"""`kestrel run SCENARIO --on hardware`: the scenario on this machine's runtime, returned as a
Trace that kestrel_cli.simulate.render_run turns into the same files as a simulated run.

    trace = run_on_hardware(scenario, console)
    metrics, files = render_run(scenario, trace)

The scenario's `hardware` must be this machine's device: a GPU description (bundled h200,
h100, or a YAML of kind gpu) or a Profile must name the local CUDA device; a CPU one
(cpu-xeon, a YAML of kind cpu, or a Profile measured on a CPU) runs on the CPU with the
torch backend (small presets or tiny model folders: what CI runs). Keys the runtime cannot
honour are refused naming the key; keys that only price the simulator's steps are ignored
with a note. torch is imported inside, so the simulator's CLI works without it.
"""

from __future__ import annotations

from rich.console import Console

from kestrel_sim.errors import KestrelError
from kestrel_sim.scenario import Scenario
from kestrel_sim.trace import Trace


class HardwareMismatchError(KestrelError):
    """The scenario's hardware is not this machine's device."""


def _squash(text: str) -> str:
    return text.lower().replace(" ", "").replace("-", "").replace("_", "")


def target_device(sc: Scenario) -> str:
    """'cpu' or 'cuda' for the scenario's hardware on this machine, or HardwareMismatchError."""
    import torch

    from kestrel_sim.hardware import load_hardware
    from kestrel_sim.profile import Profile

    if sc.hardware.endswith(".json"):
        wanted = Profile.load(sc.hardware).fingerprint.device
        kind = "cpu" if "cpu" in wanted.lower() else "gpu"
        what = f"a profile measured on '{wanted}'"
    else:
        hw = load_hardware(sc.hardware)
        wanted, kind, what = hw.name, hw.kind, f"'{hw.name}' (a {hw.kind})"
    if kind == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise HardwareMismatchError(
            f"hardware: {sc.hardware} is {what}, but this machine has no CUDA device; to run "
            "on its CPU name hardware: cpu-xeon (or a CPU profile), or run the scenario on "
            "the simulator (--on sim)")
    local = torch.cuda.get_device_name(0)
    if _squash(wanted) not in _squash(local):
        raise HardwareMismatchError(
            f"hardware: {sc.hardware} is {what}, but this machine's GPU is '{local}'; name "
            "the local GPU's hardware (or its profile), or run the scenario on the simulator "
            "(--on sim)")
    return "cuda"


def notes(sc: Scenario) -> list[str]:
    """Keys that only the simulator uses, ignored on hardware."""
    out = []
    if sc.costs is not None:
        out.append("costs: only prices the simulator's steps; ignored (every stage is measured)")
    if sc.serving.mode == "disaggregated" and sc.serving.link is not None:
        out.append("serving.link: the KV hand-over is a real copy between the workers' "
                   "caches (within a GPU, or between GPUs); the link only prices the "
                   "simulator's transfer")
    if sc.draft is not None and sc.draft.hardware is not None:
        out.append("draft.hardware: only prices the simulator's CPU draft; a cpu draft runs "
                   "on this machine's CPU")
    if sc.serving.kv_capacity_tokens is None:
        out.append("serving.kv_capacity_tokens is not set: the KV budget is the simulator's, "
                   "from the hardware description's memory and serving.kv_memory_fraction")
    return out


def run_on_hardware(scenario: Scenario, console: Console | None = None) -> Trace:
    """Run `scenario` on the local device (checked against its `hardware`); the Trace has
    source 'hardware' in its meta."""
    from kestrel_cli.render import progress_bar
    from kestrel_rt.serve import serve
    from kestrel_rt.serve.settings import refuse_unsupported

    console = console or Console(stderr=True)
    refuse_unsupported(scenario)
    device = target_device(scenario)
    for line in notes(scenario):
        console.print(f"note: {line}", highlight=False)
    console.print(f"running {scenario.name} on {device} (wall-clock arrivals; "
                  f"{scenario.workload.requests or 'all'} requests)", highlight=False)
    with progress_bar(console) as bar:
        task = bar.add_task(f"{scenario.name} on {device}", total=None)

        def status(text: str) -> None:
            bar.update(task, description=f"{scenario.name} on {device}: {text}")

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return serve(scenario, device, progress=progress, status=status).trace
