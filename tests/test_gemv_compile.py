"""The gemv kernel templates instantiate and compile for sm_90 with nvcc, for every prologue
(PRO 0 plain, 1 RMSNorm, 2 SwiGLU, each + 4 with the residual; + 8 the SwiGLU epilogue;
bf16: + 16 the row-scale RMSNorm; all: 4 + 32 the sums of squares written, 64 (+ 8) read:
gemv_variants.pros_of) and the launch variants the runtime compiles (the tuned table and the default rule), under
the names kestrel_rt/cuda/linear.py asks cupy for.
Skipped where nvcc is not on PATH. (tests/test_kernels_compile.py compiles the files as
they are, which instantiates no template.)"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from kestrel_rt.cuda import gemv_variants as V
from kestrel_rt.cuda import linear as L

NVCC = shutil.which("nvcc")
def _names(file: str) -> list[str]:
    """Every template-id Gemv compiles for `file` (not sweep mode), all prologues."""
    tuned = V.load_tuned()
    return sorted({n for pro in V.pros_of(file) for n in V.module_names(file, pro, tuned)
                   if not n.startswith("dequant_")})


def test_names_carry_the_prologue():
    assert V.kernel_name("gemv", 1, (8, 1, 4, True)) == "gemv_bf16<1, 8, 1, 4, true, 0>"
    assert V.kernel_name("gemv_int4", 2, (2, 4, 1, False), V.SWIGLU).endswith("false, 2>")
    assert V.experts_name("gemv_int8", (16, 1, 1, True), V.SWIGLU) == (
        "gemv_int8_experts<16, 1, 1, true, 2>")
    assert V.RMSNORM not in V.EXPERT_PROS
    tuned = V.load_tuned()
    for file in V.KERNELS:
        assert not any("_experts<" in n for n in V.module_names(file, V.RMSNORM, tuned))
        swiglu = [n for n in V.module_names(file, V.SWIGLU, tuned) if "_experts<" in n]
        assert len(swiglu) == len(V.GEOMETRIES)
        assert all(f", {V.expert_u(file, V.SWIGLU)}, true, 2>" in n for n in swiglu)


def test_fused_declines_what_no_kernel_takes_on_the_cpu():
    """fused() returns None for inputs no kernel reads (here: CPU tensors), so the caller
    composes the unfused ops; an RMSNorm and a SwiGLU together are a caller error."""
    torch = pytest.importorskip("torch")
    gemv = L.Gemv.__new__(L.Gemv)  # no device needed for the checks before a launch
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    assert gemv.fused(x, w) is None
    assert gemv.fused(x, w, norm=torch.ones(256, dtype=torch.bfloat16)) is None
    assert gemv.fused(torch.randn(2, 512, dtype=torch.bfloat16), w, swiglu=True) is None
    with pytest.raises(ValueError):
        gemv.fused(x, w, norm=torch.ones(256, dtype=torch.bfloat16), swiglu=True)


# Gemv's compile options: the default (late trigger) and the trigger at the top
OPTIONS = {"late": ("-DGEMV_LATE_TRIGGER",), "top": ()}


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("file", sorted(V.KERNELS))
def test_every_prologue_instantiates_for_sm90(file, options, tmp_path):
    names = _names(file)
    keep = ",\n".join(f"  (void*)&{n}" for n in names)
    src = tmp_path / f"{file}_inst.cu"
    src.write_text(L._source(file) + f"\nstatic void* keep_kernels[] = {{\n{keep}\n}};\n")
    ptx = tmp_path / f"{file}.ptx"
    result = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", *OPTIONS[options], "-ptx",
                             str(src), "-o", str(ptx)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    entries = re.findall(r"^\.visible \.entry (\w+)\(", ptx.read_text(), flags=re.MULTILINE)
    templated = [e for e in entries if not e.startswith("dequant_")]
    assert len(templated) == len(names), (len(templated), len(names))
    for pro in V.pros_of(file):  # the prologue is the last template argument (...Li<pro>EEv)
        want = sum(n.endswith(f", {pro}>") for n in names)
        assert want and sum(f"Li{pro}EEv" in e for e in templated) == want, pro
