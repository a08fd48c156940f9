"""The ring gemv kernels (kernels/gemv_ring.cu) on the CPU: every name Gemv asks cupy for
instantiates for sm_90 with nvcc, without spills (skipped where nvcc is not on PATH); the
shared-memory sizes and the routing rule (which launches take the ring)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kestrel_rt.cuda import gemv_variants as V
from kestrel_rt.cuda import linear as L

NVCC = shutil.which("nvcc")


def _gemv(ring):
    """A Gemv without a device (only the routing state), ring set for both weight kinds."""
    g = L.Gemv.__new__(L.Gemv)
    g._rings = {"gemv": None, "gemv_int4": None}
    g._bulks = {"gemv": None, "gemv_int4": None}
    g.bulk_max_rows = V.BULK_MAX_ROWS
    g.bulk_rstd = True
    g.max_shared = 227 * 1024  # an H100 / H200 block's limit
    if ring is not None:
        g.ring = g.ring_int4 = ring
    return g


def test_routing_rule():
    g = _gemv((8, 8, 1))
    assert g.ring == g.ring_int4 == (8, 8, 1)
    assert g.takes_ring("gemv", V.PLAIN, 1, 4096)
    assert g.takes_ring("gemv_int4", V.RESIDUAL, 8, 2048)
    assert g.takes_ring("gemv", V.GLU, 1, 12288)
    assert not g.takes_ring("gemv", V.PLAIN, 9, 1024)  # more rows than one n-tile
    assert not g.takes_ring("gemv", V.PLAIN, 2, 12288)  # 48 KiB of x to stage
    assert g.takes_ring("gemv", V.RMSNORM, 1, 4096)  # the norm as x is staged
    assert g.takes_ring("gemv_int4", V.RMSNORM | V.GLU, 1, 4096)
    assert not g.takes_ring("gemv", V.SWIGLU, 1, 4096)
    assert not g.takes_ring("gemv", V.RMSNORM | V.RESIDUAL, 1, 4096)
    assert not g.takes_ring("gemv", V.RSTD, 1, 4096)
    assert not g.takes_ring("gemv_int8", V.PLAIN, 1, 4096)
    assert not _gemv(None).takes_ring("gemv", V.PLAIN, 1, 4096)
    small = _gemv(V.RING_DEFAULT)
    small.max_shared = 99 * 1024  # an L4's block: the 128 KB ring does not fit
    assert not small.takes_ring("gemv", V.PLAIN, 1, 4096)
    small.max_shared = 163 * 1024  # an A100's: it fits up to 8 KB of x only
    assert small.takes_ring("gemv", V.PLAIN, 1, 4096)
    assert not small.takes_ring("gemv", V.PLAIN, 1, 12288)


@pytest.mark.parametrize("bad", [(8, 5, 1), (3, 8, 1), (8, 8, 0), (8, 8, 5), (8, 8)])
def test_ring_setting_is_checked(bad):
    with pytest.raises(ValueError, match="Gemv.ring "):
        _gemv(None).ring = bad
    with pytest.raises(ValueError, match="Gemv.ring_int4"):
        _gemv(None).ring_int4 = bad


def test_default_ring_keeps_two_blocks_off_one_sm():
    """The default (bf16) ring takes more than half of an H100 / H200 SM's 228 KiB of shared
    memory, so ring blocks placed early under PDL cannot pile up on one SM
    (kernels/gemv_ring.cu); int4 stays on the tuned kernel by default."""
    ks, slots, bps = V.RING_DEFAULT
    assert bps == 1 and (ks, slots) in V.RING_VARIANTS["gemv"]
    assert 2 * V.ring_shared_bytes("gemv", ks, slots, 1, 128) > 228 * 1024


def test_bulk_routing_and_default():
    """The bulk kernels take what the rings take (int4: x read from global memory, no staging
    limit), each ahead of its ring;
    every variant keeps one block per SM (more than half of 228 KiB) and the default fits with
    x at its largest."""
    g = _gemv(V.RING_DEFAULT)
    assert not g.takes_bulk("gemv", V.PLAIN, 1, 4096)  # None: the ring
    g.bulk_capable = True
    g.bulk = V.BULK_DEFAULT
    assert g.bulk == V.BULK_DEFAULT and g.bulk_int4 is None
    assert g.takes_bulk("gemv", V.PLAIN, 1, 4096) and g.takes_bulk("gemv", V.RMSNORM | V.GLU, 2,
                                                                   4096)
    assert not g.takes_bulk("gemv", V.PLAIN, 3, 4096)  # above BULK_MAX_ROWS: the tuned kernels
    assert not g.takes_ring("gemv", V.PLAIN, 3, 4096)  # (not the ring: bulk is set)
    g.bulk_max_rows = 8  # every row count the kernels take
    assert g.takes_bulk("gemv", V.RMSNORM | V.GLU, 4, 4096)
    assert g.takes_bulk("gemv", V.RESIDUAL, 1, 12288)
    assert not g.takes_bulk("gemv_int4", V.PLAIN, 1, 4096)  # bulk_int4 None
    assert not g.takes_bulk("gemv", V.SWIGLU, 1, 4096)
    assert not g.takes_bulk("gemv", V.PLAIN, 9, 1024)
    assert not g.takes_bulk("gemv", V.PLAIN, 2, 12288)  # 48 KiB of x
    assert not g.takes_bulk("gemv_int8", V.PLAIN, 1, 4096)
    g.bulk_int4 = V.BULK_VARIANTS["gemv_int4"][0]
    assert g.takes_bulk("gemv_int4", V.PLAIN, 8, 12288)  # x from global memory
    assert g.takes_bulk("gemv_int4", V.GLU, 1, 4096)
    assert g.takes_bulk("gemv_int4", V.RMSNORM | V.GLU, 1, 4096)
    assert not g.takes_bulk("gemv_int4", V.SWIGLU, 1, 4096)
    with pytest.raises(ValueError, match="Gemv.bulk "):
        g.bulk = (8, 7, 2048)
    with pytest.raises(ValueError, match="Gemv.bulk_int4"):
        g.bulk_int4 = (8, 6, 2048)  # a bf16 variant only
    g.bulk_capable = False
    with pytest.raises(ValueError, match="compute capability 9.0"):
        g.bulk = V.BULK_DEFAULT
    for f in V.BULK_KERNELS:
        for w, s_, c in V.BULK_VARIANTS[f]:
            assert c % (64 * w) == 0  # whole 64-byte row pieces (int4: groups) per warp
            assert 2 * V.bulk_shared_bytes(f, w, s_, c, 1, 128) > 228 * 1024
            assert (V.bulk_shared_bytes(f, w, s_, c, 1, 4096) + V.bulk_static_bytes(f, w, s_)
                    <= 227 * 1024)
    warps, slots, _ = V.BULK_DEFAULT
    assert (V.bulk_shared_bytes("gemv", *V.BULK_DEFAULT, 8, V.RING_X_BYTES // 16)
            + V.bulk_static_bytes("gemv", warps, slots) <= 227 * 1024)


def test_shared_bytes():
    # bf16: 8 slots x 256 threads x 32 bytes, then one row of 4096 bf16
    assert V.ring_shared_bytes("gemv", 8, 8, 1, 4096) == 8 * 256 * 32 + 8192
    # int4: 4 slots x 16 warps x (32 threads x two 16-byte vectors + 48 bytes of metadata),
    # whatever KSPLIT (16 warps on 16 / KSPLIT tiles)
    for ks in (16, 8, 4):
        assert V.ring_shared_bytes("gemv_int4", ks, 4, 2, 2048) == 4 * 16 * (32 * 32 + 48) + 8192
    assert [V.ring_tiles("gemv_int4", ks) for ks in (16, 8, 4)] == [1, 2, 4]
    assert V.ring_warps("gemv", 8) == 8 and V.ring_tiles("gemv", 8) == 1
    worst = max(V.ring_shared_bytes(f, ks, s, 8, V.RING_X_BYTES // 16)
                + V.ring_static_bytes(f, ks) for f in V.RING_KERNELS for ks, s in V.RING_VARIANTS[f])
    assert worst <= 227 * 1024  # what one H100 / H200 block may have


SOURCES = ("gemv_ring", "gemv_bulk")


def _compile(tmp_path, source: str, arch: str):
    """kernels/SOURCE.cu with every kernel Gemv asks cupy for (all prologues), for arch."""
    names = [n for pro in V.persistent_pros(source) for n in V.persistent_names(source, pro)]
    keep = ",\n".join(f"  (void*)&{n}" for n in names)
    src = tmp_path / f"{source}_inst.cu"
    src.write_text(L._source(source) + f"\nstatic void* keep_kernels[] = {{\n{keep}\n}};\n")
    result = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-DGEMV_LATE_TRIGGER", "-cubin",
                             "-Xptxas", "-v", str(src), "-o", str(tmp_path / f"{source}.cubin")],
                            capture_output=True, text=True, check=False)
    return names, result


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_persistent_modules_build_below_sm_90(tmp_path):
    """An A100 (sm_80) builds both modules: the bulk kernels' bodies are compiled out there
    (Gemv never routes to them: bulk_capable)."""
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
