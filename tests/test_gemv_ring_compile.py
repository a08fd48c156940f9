"""The persistent gemv kernels (kernels/gemv_ring.cu, gemv_bulk.cu) on the CPU: every name
Gemv asks cupy for instantiates with nvcc for sm_90 without spills, and for sm_80 (skipped
where nvcc is not on PATH); their shared-memory sizes. Which launches take them:
tests/test_gemv_dispatch.py."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kestrel_rt.cuda import gemv_variants as V
from kestrel_rt.cuda.module import full_source

NVCC = shutil.which("nvcc")


def test_default_ring_keeps_two_blocks_off_one_sm():
    """The default ring takes more than half of an H100 / H200 SM's 228 KiB of shared
    memory, so ring blocks placed early under PDL cannot pile up on one SM
    (kernels/gemv_ring.cu)."""
    ks, slots, bps = V.RING_DEFAULT
    assert bps == 1 and (ks, slots) in V.RING_VARIANTS
    assert 2 * V.ring_shared_bytes(ks, slots, 1, 128) > 228 * 1024


def test_every_bulk_variant_keeps_one_block_per_sm_and_fits():
    """Every bulk variant takes more than half of 228 KiB (one block per SM) and fits with x
    at its largest (the default at 8 rows of x too)."""
    for w, s_, c in V.BULK_VARIANTS:
        assert c % (64 * w) == 0  # whole 64-byte row pieces per warp
        assert 2 * V.bulk_shared_bytes(w, s_, c, 1, 128) > 228 * 1024
        assert V.bulk_shared_bytes(w, s_, c, 1, 4096) + V.bulk_static_bytes(w, s_) <= 227 * 1024
    warps, slots, _ = V.BULK_DEFAULT
    assert (V.bulk_shared_bytes(*V.BULK_DEFAULT, 8, V.RING_X_BYTES // 16)
            + V.bulk_static_bytes(warps, slots) <= 227 * 1024)


def test_shared_bytes():
    # 8 slots x 256 threads x 32 bytes, then one row of 4096 bf16
    assert V.ring_shared_bytes(8, 8, 1, 4096) == 8 * 256 * 32 + 8192
    worst = max(V.ring_shared_bytes(ks, s, 8, V.RING_X_BYTES // 16) + V.ring_static_bytes(ks)
                for ks, s in V.RING_VARIANTS)
    assert worst <= 227 * 1024  # what one H100 / H200 block may have


SOURCES = ("gemv_ring", "gemv_bulk")


def _compile(tmp_path, source: str, arch: str):
    """kernels/SOURCE.cu with every kernel Gemv asks cupy for (all prologues), for arch."""
    names = [n for pro in V.persistent_pros(source) for n in V.persistent_names(source, pro)]
    keep = ",\n".join(f"  (void*)&{n}" for n in names)
    src = tmp_path / f"{source}_inst.cu"
    src.write_text(full_source(source) + f"\nstatic void* keep_kernels[] = {{\n{keep}\n}};\n")
    result = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-DGEMV_LATE_TRIGGER", "-cubin",
                             "-Xptxas", "-v", str(src), "-o", str(tmp_path / f"{source}.cubin")],
                            capture_output=True, text=True, check=False)
    return names, result


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_persistent_modules_build_below_sm_90(tmp_path):
    """An A100 (sm_80) builds both modules: the bulk kernels' bodies are compiled out there
    (the bulk_gemv option needs compute capability 9.0)."""
    for source in SOURCES:
        _, result = _compile(tmp_path, source, "sm_80")
        assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", SOURCES)
def test_every_persistent_kernel_instantiates_without_spills(tmp_path, source):
    names, result = _compile(tmp_path, source, "sm_90")
    assert result.returncode == 0, result.stderr[-4000:]
    entries = re.findall(r"Compiling entry function '(\w+)'", result.stderr)
    assert len(entries) == len(names)
    spills = re.findall(r"(\d+) bytes spill stores", result.stderr)
    assert spills and all(s == "0" for s in spills), result.stderr[-2000:]
