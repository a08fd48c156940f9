"""The serving and SLO parts of a Scenario: workers, batching limits, KV policy, KV link.

Re-exported by kestrel_sim.scenario; read by the simulator (kestrel_sim.sim).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kestrel_sim.schema_base import StrictModel

DEVICE_NAME = re.compile(r"cpu|cuda:\d+")  # a serving.devices entry


class Link(StrictModel):
    """A KV-transfer link: transfers are serialised on it (one at a time, FIFO)."""

    bandwidth_gb_s: float = Field(gt=0, description="GB/s, 1e9 bytes per second")
    latency_us: float = Field(default=0.0, ge=0)


class Serving(StrictModel):
    mode: Literal["colocated", "disaggregated"] = "colocated"
    workers: int = Field(default=1, ge=1, description="colocated: GPUs doing both phases")
    prefill_workers: int = Field(default=1, ge=1, description="disaggregated only")
    decode_workers: int = Field(default=1, ge=1, description="disaggregated only")
    max_batch: int = Field(default=64, ge=1, description="sequences per decode batch")
    max_batched_tokens: int = Field(
        default=8192, ge=1,
        description="new tokens per forward step: a full decode batch's tokens (max_batch x "
        "(k+1) with speculation) must fit; prefill chunks get what decode leaves",
    )
    prefill_chunk: int = Field(default=2048, ge=1, description="prompt tokens per request per step")
    prefill_schedule: Literal["mixed", "alternate"] = Field(
        default="mixed",
        description="colocated only. mixed (as vLLM's chunked prefill, Sarathi-Serve): every "
        "step is one forward that carries the running requests' decode tokens (k+1 each for "
        "a speculative verify) and fills the rest of max_batched_tokens with chunks of "
        "waiting prompts (at most prefill_chunk tokens per prompt); the k draft steps and a "
        "separate correction stay their own forwards. alternate: while prompts wait, a "
        "prefill-only step alternates with a decode or speculative round",
    )
    decode_queue: Literal["fifo", "shortest-first"] = Field(
        default="fifo",
        description="the order decode workers take prefilled requests in (disaggregated; a "
        "colocated worker's prefilled requests join its batch at once): fifo, or "
        "shortest-first (fewest tokens in the sequence first, a priority queue)",
    )
    kv_capacity_tokens: int | None = Field(
        default=None, ge=1,
        description="KV slots per worker; default: free memory after weights x kv_memory_fraction",
    )
    kv_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    on_kv_full: Literal["preempt", "wait"] = Field(
        default="preempt",
        description="preempt: evict the newest running request and recompute it later; "
        "wait: reserve prompt+output at admission so nothing is ever evicted",
    )
    link: str | Link | None = Field(
        default=None, description="KV transfer link: a name from the hardware's links or "
        "{bandwidth_gb_s, latency_us}; default the hardware's default link",
    )
    devices: list[str] | None = Field(
        default=None, min_length=1,
        description="where the workers run, as torch devices ('cuda:0', 'cuda:1', or "
        "'cpu'): worker i (gpu0, gpu1, ... colocated; prefill0, ... then decode0, ... "
        "disaggregated) runs on devices[i mod len] (round-robin; one entry per worker is an "
        "explicit placement, and an entry may repeat to put two workers on one device, each "
        "on its own stream). Default on hardware: the machine's GPUs in turn (two GPUs: "
        "prefill on cuda:0, decode on cuda:1; one GPU or the CPU: every worker on it). The "
        "simulator: workers placed on one device share its bandwidth and compute, so their "
        "steps that overlap in time slow each other (kestrel_sim/costs/contention.py); "
        "without serving.devices every worker is priced as a device of its own",
    )

    @field_validator("devices")
    @classmethod
    def _device_names(cls, devices):
        if devices is None:
            return None
        bad = [d for d in devices if not DEVICE_NAME.fullmatch(d)]
        if bad:
            raise ValueError(f"unknown device {bad[0]!r}: expected 'cpu' or 'cuda:N' (N the "
                             "GPU's index, from 0)")
        if "cpu" in devices and len(set(devices)) > 1:
            raise ValueError("mixes the CPU and GPUs: place every worker on GPUs, or every "
                             "worker on the cpu")
        return devices

    @model_validator(mode="after")
    def _mode_fields(self):
        # by value (not by "was it given"), so a dumped scenario validates again
        if self.mode == "colocated":
            odd = [f for f in ("prefill_workers", "decode_workers") if getattr(self, f) != 1]
            if odd:
                raise ValueError(
                    f"{', '.join(odd)} only apply to mode: disaggregated; "
                    "colocated mode uses `workers`"
                )
        elif self.workers != 1:
            raise ValueError(
                "`workers` only applies to mode: colocated; disaggregated mode uses "
                "prefill_workers and decode_workers"
            )
        elif self.prefill_schedule != "mixed":
            raise ValueError(
                "prefill_schedule only applies to mode: colocated; disaggregated workers "
                "never mix prefill and decode"
            )
        return self


class Slo(StrictModel):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)
