"""The gemv kernel templates instantiate and compile for sm_90 with nvcc, for every PRO the
runtime compiles (0 plain, + 4 the residual, + 8 the SwiGLU epilogue; bf16: + 16 the row-scale
RMSNorm; the expert kernels: 2 the SwiGLU prologue: gemv_variants.module_pros) and the launch
variants it compiles (the tuned table and the default rule), under the names
kestrel_rt/cuda/gemv.py asks cupy for.
Skipped where nvcc is not on PATH. (tests/test_kernels_compile.py compiles the files as
they are, which instantiates no template.)"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kestrel_rt.cuda import gemv_variants as V
from kestrel_rt.cuda.module import full_source

NVCC = shutil.which("nvcc")


def _names(file: str) -> list[str]:
    """Every template-id Gemv compiles for `file` (not sweep mode), all prologues."""
    tuned = V.load_tuned()
    return sorted({n for pro in V.module_pros(file) for n in V.module_names(file, pro, tuned)
                   if not n.startswith("dequant_")})


def test_names_carry_the_prologue():
    assert V.kernel_name("gemv", 1, (8, 1, 4, True)) == "gemv_bf16<1, 8, 1, 4, true, 0>"
    assert V.kernel_name("gemv_int4", 2, (2, 4, 1, False), V.SWIGLU).endswith("false, 2>")
    assert V.experts_name("gemv_int8", (16, 1, 1, True), V.SWIGLU) == (
        "gemv_int8_experts<16, 1, 1, true, 2>")
    tuned = V.load_tuned()
    for file in V.KERNELS:
        assert not any("_experts<" in n for n in V.module_names(file, V.RESIDUAL, tuned))
        assert not any(n.endswith(", 2>") and "_experts<" not in n
                       for n in V.module_names(file, V.SWIGLU, tuned))  # experts only
        swiglu = [n for n in V.module_names(file, V.SWIGLU, tuned) if "_experts<" in n]
        assert len(swiglu) == len(V.GEOMETRIES)
        assert all(f", {V.expert_u(file, V.SWIGLU)}, true, 2>" in n for n in swiglu)


def test_fused_declines_what_no_kernel_takes_on_the_cpu():
    """fused() returns None for inputs no kernel reads (here: CPU tensors), so the caller
    composes the unfused ops."""
    from kestrel_rt.cuda.gemv import Gemv

    torch = pytest.importorskip("torch")
    gemv = Gemv.__new__(Gemv)  # no device needed for the checks before a launch
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    assert gemv.fused(x, w) is None
    assert gemv.fused(x, w, rstd=True, eps=1e-6) is None
    assert gemv.fused(x, w, glu=True) is None


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("file", sorted(V.KERNELS))
def test_every_prologue_instantiates_for_sm90(file, tmp_path):
    names = _names(file)
    keep = ",\n".join(f"  (void*)&{n}" for n in names)
    src = tmp_path / f"{file}_inst.cu"
    src.write_text(full_source(file) + f"\nstatic void* keep_kernels[] = {{\n{keep}\n}};\n")
    ptx = tmp_path / f"{file}.ptx"
    result = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-DGEMV_LATE_TRIGGER", "-ptx",
                             str(src), "-o", str(ptx)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    entries = re.findall(r"^\.visible \.entry (\w+)\(", ptx.read_text(), flags=re.MULTILINE)
    templated = [e for e in entries if not e.startswith("dequant_")]
    assert len(templated) == len(names), (len(templated), len(names))
    for pro in V.module_pros(file):  # the prologue is the last template argument (...Li<pro>EEv)
        want = sum(n.endswith(f", {pro}>") for n in names)
        assert want and sum(f"Li{pro}EEv" in e for e in templated) == want, pro
