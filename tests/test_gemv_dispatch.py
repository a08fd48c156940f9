"""The gemv plan table, the variant rules and the launches Gemv makes (CPU: no kernel runs)."""

from __future__ import annotations

import pytest
import torch

from kestrel_rt.cuda import gemv_variants as V
from kestrel_rt.cuda.gemv_plan import GemvDevice, Plan, plan
from kestrel_rt.quant_weights import Int4Weight, Int8Weight

# decode shapes (N, K) of qwen3-8b: qkv, o, gate_up, down, lm_head
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
H200 = 132, 227 * 1024  # SMs, shared bytes one block may opt in to


def device(bulk=False, ring=False, bulk_rstd=True, sms=H200[0], max_shared=H200[1]):
    return GemvDevice(sms=sms, max_shared=max_shared, bulk=bulk, ring=ring, bulk_rstd=bulk_rstd)


def test_tuned_table_is_well_formed_and_covers_qwen3_8b():
    tuned = V.load_tuned()
    assert tuned, "kestrel_rt/cuda/gemv_tuned.json is missing or empty"
    for (file, n, k, mt), variant in tuned.items():
        assert file in V.KERNELS and mt in (1, 2) and n > 0 and k > 0
        ks, tpb, u, pf = variant
        assert (ks, tpb) in V.GEOMETRIES and u >= 1 and isinstance(pf, bool)
    for file in V.KERNELS:
        for n, k in QWEN3_8B:
            assert (file, n, k, 1) in tuned and (file, n, k, 2) in tuned


def test_default_variant_fills_the_chip_and_names_a_template():
    for file in V.KERNELS:
        for n, k in [(128, 1024), (1000, 1152), (4096, 4096), (151936, 4096)]:
            ks, tpb, u, pf = V.default_variant(file, n, k, sms=132)
            assert (ks, tpb) in V.GEOMETRIES and u == V.DEFAULT_U[file] and pf
            name = V.kernel_name(file, 1, (ks, tpb, u, pf))
            assert name.startswith(V.KERNELS[file] + "<1, ")
    # a big matrix needs no K split, a small one splits K as far as it goes
    assert V.default_variant("gemv", 151936, 4096, 132)[0] == 1
    assert V.default_variant("gemv", 1024, 4096, 132)[0] == 16


def test_all_variants_per_kernel():
    for file in V.KERNELS:
        variants = V.all_variants(file)
        assert len(variants) == len(V.GEOMETRIES) * len(V.U_CHOICES[file]) * 2
        assert len(set(variants)) == len(variants)


# -- the plan table ---------------------------------------------------------------------------
@pytest.mark.parametrize("rows", range(1, 9))
def test_bulk_takes_bf16_up_to_its_rows_and_the_rest_goes_tuned(rows):
    p = plan("bf16", V.RESIDUAL, rows, 1024, 512, "down", device(bulk=True), {})
    if rows <= V.BULK_MAX_ROWS:
        assert p == Plan("bulk", V.BULK_DEFAULT)
    else:  # not the ring while the bulk kernel is on
        assert p.kernel == "tuned" and p.setting == V.default_variant("gemv", 1024, 512, 132)


def test_ring_takes_bf16_up_to_8_rows_where_there_is_no_bulk_kernel():
    dev = device(ring=True)
    for rows in range(1, 10):
        p = plan("bf16", V.PLAIN, rows, 1024, 512, "qkv", dev, {})
        assert p == (Plan("ring", V.RING_DEFAULT) if rows <= 8 else
                     Plan("tuned", V.default_variant("gemv", 1024, 512, 132)))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_weights_always_take_the_tuned_kernels(kind):
    tuned = {(V.FILES_OF[kind], 4096, 4096, 1): (2, 4, 1, True)}
    for dev in (device(bulk=True), device(ring=True)):
        assert plan(kind, V.PLAIN, 1, 4096, 4096, "o", dev, tuned) == Plan("tuned",
                                                                           (2, 4, 1, True))


def test_the_o_projection_gets_the_deeper_ring_at_one_row_where_it_has_more_tiles_than_sms():
    dev = device(bulk=True)
    assert plan("bf16", V.RESIDUAL, 1, 4096, 4096, "o", dev, {}).setting == V.BULK_AFTER_ATTENTION
    assert plan("bf16", V.RESIDUAL, 2, 4096, 4096, "o", dev, {}).setting == V.BULK_DEFAULT
    assert plan("bf16", V.RESIDUAL, 1, 1024, 4096, "o", dev, {}).setting == V.BULK_DEFAULT
    assert plan("bf16", V.RESIDUAL, 1, 4096, 4096, "down", dev, {}).setting == V.BULK_DEFAULT


def test_row_scale_and_argmax_take_the_bulk_kernel_unless_bulk_rstd_is_off():
    for pro in (V.RSTD, V.RSTD | V.GLU, V.ARGMAX, V.RSTD | V.ARGMAX):
        assert plan("bf16", pro, 1, 4096, 4096, None, device(bulk=True), {}).kernel == "bulk"
    off = device(bulk=True, bulk_rstd=False)  # a MoE model
    assert plan("bf16", V.RSTD, 1, 4096, 4096, None, off, {}).kernel == "tuned"
    assert plan("bf16", V.RSTD | V.ARGMAX, 1, 4096, 4096, None, off, {}).kernel == "tuned"
    assert plan("bf16", V.ARGMAX, 1, 4096, 4096, None, off, {}).kernel == "bulk"
    assert plan("bf16", V.RSTD, 1, 4096, 4096, None, device(ring=True), {}).kernel == "tuned"


def test_persistent_kernels_need_x_and_their_slots_in_shared_memory():
    dev = device(bulk=True)
    k_max = V.RING_X_BYTES // 2  # one row of x staged
    assert plan("bf16", V.PLAIN, 1, 1024, k_max, None, dev, {}).kernel == "bulk"
    assert plan("bf16", V.PLAIN, 1, 1024, k_max + 8, None, dev, {}).kernel == "tuned"
    small = device(bulk=True, max_shared=96 * 1024)  # less than an H100's block limit
    assert plan("bf16", V.PLAIN, 1, 1024, 512, None, small, {}).kernel == "tuned"


def test_tuned_plans_use_the_sweep_then_the_default_rule():
    tuned = {("gemv", 4096, 4096, 2): (4, 2, 8, False)}
    assert plan("bf16", V.PLAIN, 12, 4096, 4096, None, device(), tuned).setting == (4, 2, 8, False)
    assert plan("bf16", V.PLAIN, 4, 4096, 4096, None, device(), tuned).setting == (
        V.default_variant("gemv", 4096, 4096, 132))


# -- the launches ------------------------------------------------------------------------------
def recording_gemv(target: GemvDevice, monkeypatch):
    """A Gemv whose launches are recorded, not run: (kernel name, grid, block, #args, smem).
    Its modules check that each name is one the module compiles for that (file, PRO)."""
    from kestrel_rt.cuda import gemv as gemv_module
    from kestrel_rt.cuda.gemv import Gemv

    monkeypatch.setattr(gemv_module, "ensure_dynamic_shared", lambda fn, nbytes: None)

    gemv = Gemv.__new__(Gemv)  # no device: only the launch logic runs
    gemv.target, gemv.sms, gemv.tuned, gemv.sweep = target, target.sms, {}, False
    gemv._shared = {}
    calls = []

    class Module:
        def __init__(self, names):
            self.names = set(names)

        def get_function(self, name):
            assert name in self.names, f"{name} is not compiled by its module"
            return name

    def module(file, pro=V.PLAIN):
        if file in ("gemv_ring", "gemv_bulk"):
            return Module(V.persistent_names(file, pro))
        return Module(V.module_names(file, pro, {}))

    gemv.module = module
    gemv._run = lambda fn, grid, block, args, smem=0: calls.append(
        (fn, grid, block, len(args), smem))
    return gemv, calls


def weight(kind: str, n: int, k: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    if kind == "bf16":
        return w.bfloat16()
    return (Int8Weight if kind == "int8" else Int4Weight).from_float(w)


def test_each_call_picks_its_prologue_and_epilogue_kernel(monkeypatch):
    """PRO = 4 residual + 8 SwiGLU epilogue + 16 row scale; the SwiGLU epilogue halves the output and keeps the grid of the plain kernel; the argument
    lists are the kernels' (bf16 w, x, y, M, N, K, eps, res; int8 q, scale, ...; int4 q,
    zeros, scales, ...)."""
    gemv, calls = recording_gemv(device(), monkeypatch)
    m, n, k = 3, 256, 256
    x = torch.randn(m, k).bfloat16()
    res = torch.zeros(m, n).bfloat16()
    for kind, file in (("bf16", "gemv"), ("int8", "gemv_int8"), ("int4", "gemv_int4")):
        w = weight(kind, n, k)
        cases = [({}, 0, n), ({"residual": res}, 4, n), ({"glu": True}, 8, n // 2)]
        if kind == "bf16":
            cases += [({"rstd": True}, 16, n), ({"rstd": True, "glu": True}, 24, n // 2)]
        for kw, pro, width in cases:
            calls.clear()
            assert gemv.matmul(x, w, eps=1e-6, **kw).shape == (m, width)
            (name, grid, block, nargs, smem), = calls
            assert name.startswith(V.KERNELS[file] + "<1, ") and name.endswith(f", {pro}>")
            ks, tpb, _, _ = V.default_variant(file, n, k, 132)
            assert grid == (-(-n // (16 * tpb)),) and block == (32 * ks * tpb,) and smem == 0
            assert nargs == {"bf16": 8, "int8": 8, "int4": 9}[kind]


def test_persistent_launches(monkeypatch):
    """bulk: one block per SM at most, WARPS + 1 warps, slots' and x's shared bytes, 13
    arguments (ARGMAX's five null); ring: KSPLIT warps, 7 arguments."""
    k = 512
    for target, kernel in ((device(bulk=True), "bulk"), (device(ring=True), "ring")):
        gemv, calls = recording_gemv(target, monkeypatch)
        for n, m in ((256, 1), (8192, 2)):
            x = torch.randn(m, k).bfloat16()
            for kw, pro in (({}, 0), ({"residual": torch.zeros(m, n).bfloat16()}, 4),
                            ({"glu": True}, 8)):
                calls.clear()
                gemv.matmul(x, weight("bf16", n, k), **kw)
                (name, grid, block, nargs, smem), = calls
                if kernel == "bulk":
                    warps, slots, row_bytes = V.BULK_DEFAULT
                    assert name == V.bulk_name(warps, slots, row_bytes, pro)
                    assert block == (32 * (warps + 1),) and nargs == 13
                    assert smem == V.bulk_shared_bytes(warps, slots, row_bytes, m, k)
                else:
                    ks, slots, _ = V.RING_DEFAULT
                    assert name == V.ring_name(ks, slots, pro)
                    assert block == (32 * ks,) and nargs == 7
                    assert smem == V.ring_shared_bytes(ks, slots, m, k)
                assert grid == (min(n // 16, 132),)


def test_refusals_launch_nothing(monkeypatch):
    gemv, calls = recording_gemv(device(bulk=True), monkeypatch)
    x = torch.randn(1, 128).bfloat16()
    with pytest.raises(ValueError, match="row-scale RMSNorm"):
        gemv.matmul(x, weight("int8", 32, 128), rstd=True)
    with pytest.raises(ValueError, match="I % 8 == 0"):  # I = 12
        gemv.matmul(x, weight("bf16", 24, 128), glu=True)
    with pytest.raises(ValueError, match="no residual"):
        gemv.matmul(x, weight("bf16", 32, 128), glu=True, residual=torch.zeros(1, 32).bfloat16())
    with pytest.raises(ValueError, match="does not fit"):
        gemv.matmul(torch.randn(1, 64).bfloat16(), weight("bf16", 32, 128))
    assert not calls


def test_argmax_goes_to_the_bulk_kernels_argmax_epilogue(monkeypatch):
    """Gemv.argmax launches gemv_bulk_bf16 with ARGMAX (after plain x or the row scale) and
    its five extra arguments; where the bulk kernel does not take the shape (no bulk kernel,
    more than BULK_MAX_ROWS rows, an int4 weight, the row scale on a MoE model) it launches
    nothing and says so; a wrong state raises."""
    gemv, calls = recording_gemv(device(bulk=True), monkeypatch)
    gemv.supports = lambda x, w, k=None: True  # CPU tensors stand in for device ones
    k, n = 512, 50000
    w, x = weight("bf16", n, k), torch.randn(1, k).bfloat16()
    state = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
    out = torch.empty(1, dtype=torch.long)

    def argmax(x, w, rstd, state=state, out=out):
        return gemv.argmax(x, w, rstd=rstd, eps=1e-6, state=state, out=out)

    for rstd, pro in ((False, V.ARGMAX), (True, V.RSTD | V.ARGMAX)):
        calls.clear()
        assert argmax(x, w, rstd)
        (name, grid, block, nargs, smem), = calls
        assert name == V.bulk_name(*V.BULK_DEFAULT, pro)
        assert grid == (132,) and block == (32 * (V.BULK_DEFAULT[0] + 1),) and nargs == 13
        assert smem == V.bulk_shared_bytes(*V.BULK_DEFAULT, 1, k)
    calls.clear()
    three = (torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
    assert not argmax(torch.randn(3, k).bfloat16(), w, False, three, torch.empty(3).long())
    assert not argmax(x, weight("int4", n, k), False)
    gemv.target = device(bulk=True, bulk_rstd=False)
    assert not argmax(x, w, True)
    gemv.target = device(bulk=False)
    assert not argmax(x, w, False) and calls == []
    gemv.target = device(bulk=True)
    with pytest.raises(ValueError, match="argmax: keys"):
        argmax(x, w, False, three)
    unpinned = (torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="pinned int64"):
        gemv.argmax(x, w, rstd=False, eps=1e-6, state=state, out=out, host=unpinned)


@pytest.mark.parametrize("ring_us,tuned_us,kept", [(101.0, 100.0, True), (109.0, 100.0, True),
                                                  (140.0, 100.0, False)])
def test_the_ring_is_kept_only_where_it_streams(monkeypatch, ring_us, tuned_us, kept):
    from kestrel_rt.cuda import ring_probe

    monkeypatch.setattr(ring_probe, "probe_ring", lambda gemv: (ring_us, tuned_us))
    assert ring_probe.ring_streams_well(None) == kept


def test_the_ring_stays_when_the_probe_does_not_fit(monkeypatch):
    from kestrel_rt.cuda import ring_probe

    def no_memory(gemv):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(ring_probe, "probe_ring", no_memory)
    assert ring_probe.ring_streams_well(None)
