"""The rmsnorm launch on the host (CPU: no kernel runs here): ops.rms_norm(early=True) takes
rmsnorm_early_* only where a row is at most one 16-byte vector per thread, both entries take
the same argument list, and every name it can ask for is compiled."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kestrel_rt.cuda import ops


class _Recorder:
    def __init__(self):
        self.launches = []

    def launch(self, file, name, grid, block, args, shared_mem=0):
        self.launches.append((file, name, grid, block, args))


@pytest.mark.parametrize("n,early,want", [
    (4096, True, "rmsnorm_early_bf16"),   # 512 threads x 8: one vector each
    (8192, True, "rmsnorm_early_bf16"),   # 1024 x 8: still one vector each
    (16384, True, "rmsnorm_bf16"),        # 2048 vectors, 1024 threads: the looping kernel
    (100, True, "rmsnorm_bf16"),          # n % 8 != 0: no 16-byte vectors
    (4096, False, "rmsnorm_bf16"),
])
def test_early_entry_only_where_a_row_is_one_vector_per_thread(monkeypatch, n, early, want):
    monkeypatch.setattr(ops, "_suffix", lambda *tensors: "bf16")  # CPU tensors stand in
    km = _Recorder()
    x = torch.zeros(3, n, dtype=torch.bfloat16)
    ops.rms_norm(km, x, torch.ones(n, dtype=torch.bfloat16), 1e-6, early=early)
    (file, name, grid, block, args), = km.launches
    assert (file, name, grid) == ("rmsnorm", want, (3,))
    assert [type(a) for a in args] == [np.uint64] * 5 + [np.int32, np.float32, np.int32]
    assert block[0] * 8 >= n or name == "rmsnorm_bf16"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_every_rmsnorm_entry_is_compiled_with_one_signature(tmp_path):
    from kestrel_rt.cuda.module import full_source

    src = tmp_path / "rmsnorm.cu"
    src.write_text(full_source("rmsnorm"))
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", str(src), "-o",
                    str(tmp_path / "r.ptx")], check=True, capture_output=True)
    ptx = (tmp_path / "r.ptx").read_text()
    params = {}
    for name, body in re.findall(r"\.entry\s+(\w+)\((.*?)\)", ptx, re.DOTALL):
        params[name] = re.findall(r"\.param\s+\.(\w+)", body)
    names = {f"rmsnorm_{pre}{sfx}" for pre in ("", "early_") for sfx in ("bf16", "f32")}
    assert names <= set(params)
    assert len({tuple(params[n]) for n in names}) == 1
