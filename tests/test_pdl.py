"""The PDL launcher's driver structures and argument packing (CPU: no launch here; the GPU
tests launch every kernel through it)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kestrel_rt.cuda.pdl import LaunchAttribute, LaunchConfig, kernel_params

NVCC = shutil.which("nvcc")


def _cuda_include() -> Path | None:
    if NVCC is None:
        return None
    for base in (Path(NVCC).resolve().parents[1], Path("/usr/local/cuda")):
        for inc in (base / "include", *base.glob("cuda-*/include")):
            if (inc / "cuda.h").is_file():
                return inc
    return None


@pytest.mark.skipif(_cuda_include() is None or shutil.which("gcc") is None,
                    reason="cuda.h or gcc not found")
def test_structures_match_cuda_h(tmp_path):
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\n"
        "int main(void) { printf(\"%zu %zu %zu %zu %zu %zu\", sizeof(CUlaunchAttribute), "
        "sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream), "
        "offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), "
        "offsetof(CUlaunchAttribute, value)); return 0; }\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", f"-I{_cuda_include()}", str(src), "-o", str(exe)], check=True)
    expect = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True,
                                             check=True).stdout.split()]
    ours = [ctypes.sizeof(LaunchAttribute), ctypes.sizeof(LaunchConfig),
            LaunchConfig.hStream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.numAttrs.offset, LaunchAttribute.value.offset]
    assert ours == expect


def test_kernel_params_point_at_typed_values():
    args = (np.uint64(2**40 + 3), np.int32(-7), np.int64(-(2**40)), np.float32(0.5))
    params, values = kernel_params(args)
    assert len(params) == 4
    read = [ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64)).contents.value,
            ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32)).contents.value,
            ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int64)).contents.value,
            ctypes.cast(params[3], ctypes.POINTER(ctypes.c_float)).contents.value]
    assert read == [2**40 + 3, -7, -(2**40), 0.5]
    assert len(values) == 4


def test_kernel_params_refuse_python_scalars():
    with pytest.raises(TypeError, match="kernel argument 3 of type int"):
        kernel_params((np.int32(1), 3))
