"""The decode attention kernel's launch on the host (CPU: no kernel runs here): the argument
list _warp_decode builds has the kinds of kernels/decode_attention.cu's entry macro (min_keys
last)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kestrel_rt.cuda import attention

KINDS = {"int": np.int32, "float": np.float32, "long long": np.int64}


def _signature() -> list[type]:
    """Argument kinds of DECODE_ENTRY (pointers as np.uint64)."""
    from kernels import KERNEL_DIR

    src = (KERNEL_DIR / "decode_attention.cu").read_text().replace("\\\n", " ")
    params = re.search(r"#define DECODE_ENTRY\(.*?NAME\((.*?)\)\s*\{", src).group(1)
    kinds = []
    for p in params.split(","):
        p = " ".join(p.split())
        kinds.append(np.uint64 if "*" in p else KINDS[p.rsplit(" ", 1)[0].replace("const ", "")])
    return kinds


class _Recorder:
    def __init__(self):
        self.launches, self.workspaces = [], {}

    def launch(self, file, name, grid, block, args, shared_mem=0):
        self.launches.append((file, name, grid, block, args))


@pytest.mark.parametrize("rope", [False, True])
def test_decode_launch_matches_the_kernel(monkeypatch, rope):
    monkeypatch.setattr(attention, "_tickets", lambda km, n, device: torch.zeros(1024,
                                                                                 dtype=torch.int32))
    B, M, Hq, Hkv, D, max_len = 2, 1, 32, 8, 128, 64
    q = torch.zeros(B, M, Hq, D, dtype=torch.bfloat16)
    k, v = torch.zeros(B, M, Hkv, D, dtype=torch.bfloat16), torch.zeros(B, M, Hkv, D,
                                                                          dtype=torch.bfloat16)
    cache = torch.zeros(B, max_len, Hkv, D, dtype=torch.bfloat16)
    slots, positions = torch.arange(B), torch.zeros(B, M, dtype=torch.long)
    tables = (torch.ones(D, dtype=torch.bfloat16), torch.ones(D, dtype=torch.bfloat16),
              torch.zeros(max_len, D, dtype=torch.bfloat16),
              torch.zeros(max_len, D, dtype=torch.bfloat16), 1e-6)
    km = _Recorder()
    attention._warp_decode(km, "bf16", q, cache, cache.clone(), slots, positions, 132,
                           torch.empty_like(q), new=(k, v), rope=tables if rope else None,
                           min_keys=16)
    (file, name, grid, block, args), = km.launches
    assert file == "decode_attention" and block == (32 * attention.DECODE_WARPS,)
    assert grid == (B * Hkv, attention.decode_splits(B, Hkv, max_len, 132))
    assert name == f"attn_decode_{'rope_' if rope else ''}bf16_d4_r4"
    assert [type(a) for a in args] == _signature()
    assert int(args[-1]) == 16


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_every_decode_entry_is_compiled(tmp_path):
    """Each name _warp_decode can ask for (dtype, rope, head_dim / 32, rows) is an entry
    of the compiled module."""
    from kestrel_rt.cuda.module import full_source

    src = tmp_path / "decode_attention.cu"
    src.write_text(full_source("decode_attention"))
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", str(src), "-o",
                    str(tmp_path / "d.ptx")], check=True, capture_output=True)
    entries = set(re.findall(r"\.entry\s+(\w+)", (tmp_path / "d.ptx").read_text()))
    for sfx in ("bf16", "f32"):
        for pre in ("", "rope_"):
            for d in attention.DECODE_HEAD_DIMS:
                for rb in (2, 4, 8):
                    assert f"attn_decode_{pre}{sfx}_d{d // 32}_r{rb}" in entries
