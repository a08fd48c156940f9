"""bench/int4_lean_probe.py's lean_pack: every nibble and meta word where the probe kernel's
header says (CPU; the kernel itself is checked against lean_reference on the GPU)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from int4_lean_probe import fits, lean_pack, lean_reference, parse_setting


def _int4(n: int, k: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // 128, generator=gen) + 0.5).half()
    return q, z, s


def _f16(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(
        torch.float16).item()


def _assert_nibbles(words: torch.Tensor, q: torch.Tensor, slots) -> None:
    """Word `step` of lane (g, t) in chunk c of tile T holds, at nibble p, q at (row 16 T + g +
    dr, k 64 c + 16 step + 2 t + dk) for slots[p] = (dr, dk), and at nibble 4 + p the next k."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    tiles, chunks = words.shape[:2]
    for tile in range(tiles):
        for c in range(chunks):
            for lane in range(32):
                g, t = divmod(lane, 4)
                for step in range(4):
                    word = int(w[tile, c, lane, step])
                    for p, (dr, dk) in enumerate(slots):
                        row, col = 16 * tile + g + dr, 64 * c + 16 * step + 2 * t + dk
                        assert (word >> (4 * p)) & 15 == q[row, col]
                        assert (word >> (16 + 4 * p)) & 15 == q[row, col + 1]


def test_lean_pack_puts_each_value_in_its_fragment_slot():
    n, k = 32, 256
    q, z, s = _int4(n, k)
    words, meta = lean_pack(q, z, s)
    assert words.shape == (n // 16, k // 64, 32, 4) and words.dtype == torch.int32
    assert meta.shape == (n // 16, k // 128, 8, 2) and meta.dtype == torch.int32
    # nibble p (row g + dr, k 2t + dk of the step) and 4 + p (the next k): a0, a1, a2, a3
    _assert_nibbles(words, q, ((0, 0), (8, 0), (0, 8), (8, 8)))
    m = meta.to(torch.int64) & 0xFFFFFFFF
    for tile in range(n // 16):
        for grp in range(k // 128):
            for g in range(8):
                for h in range(2):
                    row, v = 16 * tile + g + 8 * h, int(m[tile, grp, g, h])
                    zero = torch.tensor([v >> 16], dtype=torch.int32).to(torch.int16)
                    assert _f16(v) == s[row, grp].item()
                    assert zero.view(torch.bfloat16).item() == 128 + int(z[row, grp])


def test_lean_pack16_puts_each_value_where_the_fp16_kernel_reads_it():
    """The fp16 layout: nibbles 0 / 4 row g (k 2t, 2t + 1), 1 / 5 row g (k 2t + 8, 2t + 9), 2 / 6
    row g + 8 (k 2t, ...), 3 / 7 row g + 8 (k 2t + 8, ...); meta (scales of g, g + 8), (-(1024 +
    z) of g, g + 8) in fp16."""
    n, k = 32, 128
    q, z, s = _int4(n, k)
    words, meta = lean_pack(q, z, s, f16=True)
    _assert_nibbles(words, q, ((0, 0), (0, 8), (8, 0), (8, 8)))  # a0, a2 from w; a1, a3 from w >> 8
    m = meta.to(torch.int64) & 0xFFFFFFFF
    for tile in range(n // 16):
        for g in range(8):
            rows = (16 * tile + g, 16 * tile + g + 8)
            scales, zeros = int(m[tile, 0, g, 0]), int(m[tile, 0, g, 1])
            assert (_f16(scales), _f16(scales >> 16)) == tuple(s[r, 0].item() for r in rows)
            assert (_f16(zeros), _f16(zeros >> 16)) == tuple(-1024.0 - int(z[r, 0]) for r in rows)


def test_lean_pack_rejects_shapes_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="N % 32 == 0 and K % 128 == 0"):
        lean_pack(torch.zeros(16, 128, dtype=torch.uint8), torch.zeros(16, 1),
                  torch.zeros(16, 1).half())


def test_lean_reference_is_the_dequantized_product():
    q = torch.tensor([[3] * 128 + [0] * 128] * 32, dtype=torch.uint8)
    z = torch.tensor([[1, 0]] * 32, dtype=torch.uint8)
    s = torch.tensor([[0.5, 1.0]] * 32).half()
    x = torch.ones(256)
    assert torch.equal(lean_reference(q, z, s, x), torch.full((32,), 128.0))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_probe_kernel_compiles_for_sm90(tmp_path):
    from kernels import KERNEL_DIR

    probe = Path(__file__).resolve().parents[1] / "bench" / "int4_lean_probe.cu"
    src = tmp_path / "probe.cu"
    args = "(const uint4*, const uint2*, const u32*, u16*, int, int);\n"
    src.write_text(probe.read_text() + "\ntemplate __global__ void int4_lean<8, 2, true>" + args
                   + "template __global__ void int4_lean<8, 2, false>" + args
                   + "template __global__ void int4_lean_bulk<8, 8, 8>" + args)
    result = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", f"-I{KERNEL_DIR}", str(src), "-o",
         str(tmp_path / "probe.ptx")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert ".entry" in (tmp_path / "probe.ptx").read_text()


def test_settings_parse_and_fit_where_the_kernels_take_them():
    assert parse_setting("8.2") == ("r", 8, 2, 0) and parse_setting("h8.3.2") == ("h", 8, 3, 2)
    assert parse_setting("b8.10.8") == ("b", 8, 10, 8)
    assert fits(("h", 16, 2, 0), 4096, 4096) and not fits(("r", 64, 2, 0), 4096, 4096)
    assert fits(("b", 8, 12, 8), 4096, 4096)
    assert not fits(("b", 8, 12, 8), 4096, 12288)  # shared memory
    assert not fits(("b", 16, 4, 8), 4096, 4096)  # a consumer warp per group of the item at least
    for bad in ("b8.2", "h8", "x8.2", "8.2.1.1"):
        with pytest.raises(ValueError, match=r"KS.STAGES\[.BPS\], hKS.STAGES"):
            parse_setting(bad)
