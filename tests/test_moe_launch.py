"""The MoE expert kernels' launch shapes (CPU: no kernel runs here): one warp per output,
a chunk instantiation that covers a row when there is one, and every kernel the host may
ask for exists in kernels/moe.cu (compiled with nvcc where it is on PATH)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kestrel_rt.cuda import ops

NVCC = shutil.which("nvcc")
DTYPES = (torch.bfloat16, torch.float32)
# (N, H, I, top_k): Qwen3-30B-A3B, the GPU tests' shapes, several chunks per row, top_k > 8
SHAPES = [(1, 2048, 768, 8), (16, 2048, 768, 8), (7, 256, 128, 4), (3, 40, 24, 2),
          (5, 776, 200, 3), (2, 2056, 776, 8), (16, 128, 64, 10), (1, 64, 32, 1),
          (1, 4096, 1536, 8), (1, 7168, 2048, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,I,k", SHAPES)
def test_one_warp_per_output(dtype, N, H, I, k):
    (gate_up, gu_grid, block), (down, down_grid, block2) = ops.moe_launches(dtype, N, H, I, k)
    warps = block[0] // 32
    assert block == block2 == (ops.MOE_THREADS,)
    assert gu_grid[0] == N * k and 0 <= gu_grid[1] * warps - I < warps
    assert down_grid[0] == N and 0 <= down_grid[1] * warps - H < warps
    sfx = ops.SUFFIX[dtype]
    assert gate_up.startswith(f"moe_gate_up_{sfx}_u")
    assert down.startswith(f"moe_down_{sfx}_u")


def test_chunk_covers_a_row_when_one_fits():
    # 32 lanes x U vectors x 8 bf16: gate_up of Qwen3-30B-A3B (H 2048) is one chunk of U 8,
    # down (I 768) one chunk of U 3: every weight load of a warp in flight at once
    (gate_up, _, _), (down, grid, _) = ops.moe_launches(torch.bfloat16, 1, 2048, 768, 8)
    assert (gate_up, down) == ("moe_gate_up_bf16_u8", "moe_down_bf16_u3")
    assert grid == (1, 256)  # one wave at 2 blocks per SM on 132 SMs
    assert ops._moe_u(24, 8, ops.MOE_GATE_UP_U) == 1
    assert ops._moe_u(776, 8, ops.MOE_DOWN_U[torch.bfloat16]) == 3  # two chunks
    assert ops._moe_u(512, 4, ops.MOE_DOWN_U[torch.float32]) == 2  # 2 chunks of 256
    assert ops._moe_u(2056, 8, ops.MOE_GATE_UP_U) == 8


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_every_launched_kernel_is_compiled(tmp_path):
    from kestrel_rt.cuda.module import full_source

    src = tmp_path / "moe.cu"
    src.write_text(full_source("moe"))
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-ptx", str(src), "-o",
                    str(tmp_path / "moe.ptx")], check=True, capture_output=True)
    entries = set(re.findall(r"\.entry\s+(\w+)", (tmp_path / "moe.ptx").read_text()))
    for dtype in DTYPES:
        for N, H, I, k in SHAPES:
            for name, _, _ in ops.moe_launches(dtype, N, H, I, k):
                assert name in entries, name
        for u in ops.MOE_GATE_UP_U:
            assert f"moe_gate_up_{ops.SUFFIX[dtype]}_u{u}" in entries
        for u in ops.MOE_DOWN_U[dtype]:
            assert f"moe_down_{ops.SUFFIX[dtype]}_u{u}" in entries


# -- ops.moe_experts on the host: what it launches, against the kernels' signatures --
KINDS = {"int": np.int32, "float": np.float32}


def _signature(name: str) -> list[type]:
    """The argument kinds of kernels/moe.cu's entry macro for kernel `name` (pointers as
    np.uint64)."""
    from kernels import KERNEL_DIR

    base = re.sub(r"_(bf16|f32)_u\d+$", "", name)
    src = (KERNEL_DIR / "moe.cu").read_text().replace("\\\n", " ")  # macros on one line
    params = re.search(rf"#define {base.upper()}_ENTRY\(.*?{base}_##SUFFIX##_u##U\((.*?)\)",
                       src).group(1)
    kinds = []
    for p in params.split(","):
        p = " ".join(p.split())
        kinds.append(np.uint64 if "*" in p else KINDS[p.split()[-2]])
    return kinds


class _Recorder:
    def __init__(self):
        self.launches = []

    def launch(self, file, name, grid, block, args, shared_mem=0):
        self.launches.append((file, name, grid, block, args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_launches_match_the_kernels(monkeypatch, dtype):
    """CPU tensors stand in for CUDA ones (the device check is skipped): two launches, the
    grids of moe_launches, each argument list of the kernel's kinds, the routing in its
    place, moe_down's early loads on."""
    monkeypatch.setattr(ops, "dtype_suffix", lambda *t: ops.SUFFIX[t[0].dtype])
    N, E, k, H, I = 3, 16, 4, 256, 64
    x = torch.zeros(N, H, dtype=dtype)
    gate_up, down = torch.zeros(E, 2 * I, H, dtype=dtype), torch.zeros(E, H, I, dtype=dtype)
    w, e = torch.zeros(N, k, dtype=dtype), torch.zeros(N, k, dtype=torch.long)
    km = _Recorder()
    out = ops.moe_experts(km, x, w, e, gate_up, down, residual=x, row_eps=1e-6)
    assert out.shape == (N, H)
    assert [(n, g, b) for _, n, g, b, _ in km.launches] == ops.moe_launches(dtype, N, H, I, k)
    for _, name, _, _, args in km.launches:
        assert [type(a) for a in args] == _signature(name), name
    (_, _, _, _, gu_args), (_, _, _, _, down_args) = km.launches
    assert gu_args[2] == e.data_ptr() and float(gu_args[-1]) == pytest.approx(1e-6)
    assert down_args[2:4] == (e.data_ptr(), w.data_ptr()) and int(down_args[-1]) == 1
