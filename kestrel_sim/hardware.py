"""Hardware descriptions: what the roofline cost model needs to know about a device.

Bundled descriptions live in kestrel_sim/hardware/*.yaml (h200, h100, cpu-xeon); a
scenario may also name its own YAML file with the same keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kestrel_sim.errors import ConfigError
from kestrel_sim.yamlio import load_model  # FILE:LINE: key: problem messages

BUNDLED_DIR = Path(__file__).resolve().parent / "hardware"


class LinkSpec(BaseModel):
    """A point-to-point link (KV transfer between workers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_gb_s: float = Field(gt=0)
    latency_us: float = Field(default=0.0, ge=0)

    def seconds(self, nbytes: float) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9)


class Hardware(BaseModel):
    """One device: memory, achieved bandwidth and matmul throughput, fixed overheads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["gpu", "cpu"] = "gpu"
    memory_gb: float = Field(gt=0)
    free_memory_gb: float | None = Field(
        default=None, gt=0, description="memory a process finds free on the idle device "
        "(torch.cuda.mem_get_info), where the KV slots are planned (kestrel_sim/sim/slots.py); "
        "default memory_gb")
    mem_bandwidth_tb_s: float = Field(gt=0, description="achieved, e.g. a device-to-device copy")
    matmul_tflops: float = Field(gt=0, description="achieved bf16 GEMM throughput")
    attention_tflops: float | None = Field(
        default=None, gt=0, description="attention throughput; default 60% of matmul_tflops"
    )
    launch_us: float = Field(default=1.0, ge=0, description="per kernel")
    step_overhead_us: float = Field(default=50.0, ge=0, description="fixed per step")
    kernels_per_layer: int = Field(default=10, ge=0)
    bytes_per_param: float = Field(default=2.0, gt=0, description="weights dtype (bf16 = 2)")
    bytes_per_kv: float = Field(default=2.0, gt=0, description="KV cache dtype (bf16 = 2)")
    links: dict[str, LinkSpec] = Field(default_factory=dict)
    default_link: str | None = None

    @model_validator(mode="after")
    def _default_link_known(self):
        if self.default_link is not None and self.default_link not in self.links:
            raise ValueError(
                f"default_link '{self.default_link}' is not one of links: "
                f"{', '.join(self.links) or '(none)'}"
            )
        return self

    def link(self, name: str | None) -> LinkSpec:
        """The named link (or the default one), or an error listing the known ones."""
        name = name or self.default_link
        if name is None or name not in self.links:
            raise ConfigError(
                f"hardware '{self.name}' has no link '{name}': expected one of "
                f"{', '.join(self.links) or '(none defined)'}, or give serving.link as "
                "{bandwidth_gb_s: ..., latency_us: ...}"
            )
        return self.links[name]


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str) -> Hardware:
    """A bundled description by name, or a hardware YAML file by path."""
    path = BUNDLED_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"unknown hardware '{name_or_path}': expected one of {', '.join(bundled_names())} "
            "or a path to a hardware YAML file"
        )
    return load_model(path, Hardware)


def hardware_for_device(device_name: str) -> Hardware | None:
    """The bundled description whose name appears in a device string such as
    'NVIDIA H200' (a Profile's fingerprint), or None."""
    low = device_name.lower().replace(" ", "")
    for name in bundled_names():
        if name.replace("-", "") in low:
            return load_hardware(name)
    return None
