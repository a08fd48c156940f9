"""A Tracer over the several devices of a serving run (kestrel_rt.trace.Tracer on one).

CUDA events of two devices cannot be compared directly, so each GPU gets its own reference
event, recorded on an idle device right after the origin and placed on the host clock when
it completes; a span's events are timed against the reference of the device they were
recorded on (the current device: the worker's, inside its stream). On one device (or the
CPU) this is kestrel_rt.trace.Tracer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel_rt.trace import Tracer


@dataclass(slots=True)
class DeviceMark:
    """A CUDA event and the index of the device it was recorded on."""

    event: object
    device: int


class DevicesTracer(Tracer):
    def __init__(self, devices: list[torch.device]) -> None:
        gpus = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        super().__init__(torch.device("cuda", gpus[0]) if gpus else None)
        self.gpus = gpus
        self.refs = {gpus[0]: (self.ref, 0.0)} if gpus else {}  # index -> (event, seconds)
        for index in gpus[1:]:
            torch.cuda.synchronize(index)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(torch.cuda.current_stream(index))
            ref.synchronize()
            self.refs[index] = (ref, self.now())

    def mark(self, on_device: bool) -> object:
        if not (on_device and self.cuda):
            return self.now()
        index = torch.cuda.current_device()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(index))
        return DeviceMark(event, index)

    def seconds(self, mark: object) -> float:
        if isinstance(mark, DeviceMark):
            ref, at = self.refs[mark.device]
            return at + ref.elapsed_time(mark.event) / 1e3
        return super().seconds(mark)

    def collect(self):
        for index in self.gpus:
            torch.cuda.synchronize(index)
        return super().collect()
