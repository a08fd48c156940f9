"""The gemv launch table and variant rules (CPU: no kernel runs here)."""

from __future__ import annotations

import pytest

from kestrel_rt.cuda import gemv_variants as V

# decode shapes (N, K) of qwen3-8b: qkv, o, gate_up, down, lm_head
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]


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


def _recording_gemv(ring=None):
    """A Gemv whose launches are recorded, not run: (kernel name, grid, block, #args). Its
    modules check that each name is one module_names compiles for that (file, PRO). ring:
    its ring setting for bf16 and int4 (None: the tuned kernels); ring launches record
    (name, grid, block, #args, shared bytes)."""
    from kestrel_rt.cuda.linear import Gemv

    gemv = Gemv.__new__(Gemv)  # no device: only the launch logic runs
    gemv.tuned, gemv.sms, gemv.sweep = {}, 132, False
    gemv._rings = {"gemv": None, "gemv_int4": None}
    gemv._bulks = {"gemv": None, "gemv_int4": None}
    gemv.bulk_max_rows = V.BULK_MAX_ROWS
    gemv.bulk_rstd = True
    gemv.max_shared = 227 * 1024  # an H100 / H200 block's limit
    gemv.ring = gemv.ring_int4 = ring
    calls = []

    class Module:
        def __init__(self, names):
            self.names = set(names)

        def get_function(self, name):
            assert name in self.names, f"{name} is not compiled by its module"
            return name

    gemv._module = lambda file, pro=V.PLAIN: Module(V.module_names(file, pro, {}))
    gemv._run = lambda fn, grid, block, args, *smem: calls.append(
        (fn, grid, block, len(args), *smem))
    ring_names = {n for source in ("gemv_ring", "gemv_bulk") for pro in V.persistent_pros(source)
                  for n in V.persistent_names(source, pro)}
    gemv._persistent_module = lambda source, pro: Module(
        set(V.persistent_names(source, pro)))
    gemv._shared_set = {name: 1 << 30 for name in ring_names}  # no driver call here
    return gemv, calls


def _weight(kind: str, n: int, k: int):
    import torch

    from kestrel_rt.quant_weights import Int4Weight, Int8Weight

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    if kind == "bf16":
        return w.bfloat16()
    return (Int8Weight if kind == "int8" else Int4Weight).from_float(w)


def test_each_call_picks_its_prologue_and_epilogue_kernel():
    """PRO = prologue (0 plain, 1 RMSNorm, 2 SwiGLU) + 4 residual + 8 SwiGLU epilogue; the
    SwiGLU epilogue halves the output and keeps the grid of the plain kernel."""
    import torch

    gemv, calls = _recording_gemv()
    m, n, k = 3, 256, 256
    x = torch.randn(m, k).bfloat16()
    norm = torch.ones(k).bfloat16()
    res = torch.zeros(m, n).bfloat16()
    for kind, file in (("bf16", "gemv"), ("int8", "gemv_int8"), ("int4", "gemv_int4")):
        w = _weight(kind, n, k)
        run = getattr(gemv, kind)
        cases = [({}, 0, n), ({"residual": res}, 4, n), ({"norm": norm}, 1, n),
                 ({"norm": norm, "residual": res}, 5, n), ({"glu": True}, 8, n // 2),
                 ({"glu": True, "norm": norm}, 9, n // 2)]
        for kw, pro, width in cases:
            calls.clear()
            y = run(x, w, **kw)
            assert y.shape == (m, width)
            (name, grid, block, nargs), = calls
            assert name.startswith(V.KERNELS[file] + "<1, ") and name.endswith(f", {pro}>")
            ks, tpb, _, _ = V.default_variant(file, n, k, 132)
            assert grid == (-(-n // (16 * tpb)),) and block == (32 * ks * tpb,)
            assert nargs == {"bf16": 11, "int8": 12, "int4": 13}[kind]
        if kind == "bf16":  # the row-scale RMSNorm (+ 16), alone and with the SwiGLU epilogue
            for kw, pro, width in (({"rstd": True}, 16, n), ({"rstd": True, "glu": True}, 24,
                                                            n // 2)):
                calls.clear()
                assert run(x, w, eps=1e-6, **kw).shape == (m, width)
                assert calls[0][0].endswith(f", {pro}>")
        gu = torch.randn(m, 2 * k).bfloat16()
        calls.clear()
        assert run(gu, w, swiglu=True, residual=res).shape == (m, n)
        assert calls[0][0].endswith(", 6>")


def test_ring_dispatch():
    """With a ring set, bf16 / int4 launches of <= 8 rows with plain x or its RMSNorm, a
    residual or the SwiGLU epilogue go to gemv_ring.cu: one block per SM at most, KSPLIT warps,
    the ring's and x's shared bytes; int8, the SwiGLU prologue and 9 rows do not."""
    import torch

    gemv, calls = _recording_gemv(ring=(16, 8, 1))
    k = 512
    for kind, file, n in (("bf16", "gemv", 256), ("bf16", "gemv", 8192), ("int4", "gemv_int4", 256)):
        w = _weight(kind, n, k)
        for m in (1, 8):
            x = torch.randn(m, k).bfloat16()
            for kw, pro in (({}, 0), ({"residual": torch.zeros(m, n).bfloat16()}, 4),
                            ({"glu": True}, 8), ({"norm": torch.ones(k).bfloat16()}, 1)):
                calls.clear()
                getattr(gemv, kind)(x, w, **kw)
                (name, grid, block, nargs, smem), = calls
                assert name == V.ring_name(file, 16, 8, pro)
                assert grid == (min(n // 16, 132),) and block == (512,)
                assert nargs == (9 if kind == "bf16" else 11)
                assert smem == V.ring_shared_bytes(file, 16, 8, m, k)
    x = torch.randn(1, k).bfloat16()
    for call in (lambda: gemv.int8(x, _weight("int8", 256, k)),
                 lambda: gemv.bf16(torch.randn(9, k).bfloat16(), _weight("bf16", 256, k)),
                 lambda: gemv.bf16(torch.randn(1, 2 * k).bfloat16(), _weight("bf16", 256, k),
                                   swiglu=True)):
        calls.clear()
        call()
        assert len(calls) == 1 and len(calls[0]) == 4  # a tuned kernel, no shared bytes


def test_bulk_dispatch():
    """With bulk / bulk_int4 set, the launches the rings would take go to gemv_bulk_bf16 /
    gemv_bulk_int4 instead (one block per SM at most, WARPS + 1 warps, the slots' shared bytes,
    and x's for bf16); without, int4 goes back to its ring."""
    import torch

    gemv, calls = _recording_gemv(ring=(16, 8, 1))
    gemv.bulk = V.BULK_DEFAULT
    gemv.bulk_max_rows = 8  # every row count the kernels take
    k = 512
    for file, kind, setting in (("gemv", "bf16", V.BULK_DEFAULT),
                                ("gemv_int4", "int4", V.BULK_VARIANTS["gemv_int4"][1])):
        gemv.bulk_int4 = setting if kind == "int4" else None
        warps, slots, row_bytes = setting
        for n, m in ((256, 1), (8192, 8)):
            x = torch.randn(m, k).bfloat16()
            for kw, pro in (({}, 0), ({"residual": torch.zeros(m, n).bfloat16()}, 4),
                            ({"glu": True}, 8), ({"norm": torch.ones(k).bfloat16()}, 1),
                            ({"norm": torch.ones(k).bfloat16(), "glu": True}, 9)):
                calls.clear()
                getattr(gemv, kind)(x, _weight(kind, n, k), **kw)
                (name, grid, block, nargs, smem), = calls
                assert name == V.bulk_name(file, warps, slots, row_bytes, pro)
                assert grid == (min(n // 16, 132),) and block == (32 * (warps + 1),)
                assert nargs == (14 if kind == "bf16" else 11)  # bf16: + ARGMAX's five
                assert smem == V.bulk_shared_bytes(file, warps, slots, row_bytes, m, k)
    gemv.bulk_int4 = None
    calls.clear()
    gemv.int4(torch.randn(1, k).bfloat16(), _weight("int4", 256, k))
    assert calls[0][0] == V.ring_name("gemv_int4", 16, 8, 0)


def test_bulk_takes_up_to_bulk_max_rows_and_the_rest_goes_tuned():
    """Above bulk_max_rows (BULK_MAX_ROWS = 2 by default) a launch goes to the tuned kernel,
    not to the ring, while a bulk setting is there; without one the ring takes it again."""
    import torch

    gemv, calls = _recording_gemv(ring=(16, 8, 1))
    gemv.bulk = V.BULK_DEFAULT
    k, n = 512, 1024
    for m in range(1, 9):
        calls.clear()
        gemv.bf16(torch.randn(m, k).bfloat16(), _weight("bf16", n, k))
        (call,) = calls
        if m <= V.BULK_MAX_ROWS:
            assert call[0] == V.bulk_name("gemv", *V.BULK_DEFAULT, 0)
        else:
            assert call[0].startswith("gemv_bf16<") and len(call) == 4  # tuned, no smem
    gemv.bulk_max_rows = 8  # the kernels take up to 8 rows
    calls.clear()
    gemv.bf16(torch.randn(8, k).bfloat16(), _weight("bf16", n, k))
    assert calls[0][0] == V.bulk_name("gemv", *V.BULK_DEFAULT, 0)
    gemv.bulk = None
    calls.clear()
    gemv.bf16(torch.randn(8, k).bfloat16(), _weight("bf16", n, k))
    assert calls[0][0] == V.ring_name("gemv", 16, 8, 0)


def test_int4_ring_blocks_take_several_tiles():
    """The int4 ring kernel has 16 warps whatever KSPLIT, on 16 / KSPLIT tiles at a time: its
    grid counts sets of tiles (at most one block per SM and BPS), its shared memory 16 warps'
    slots; the bf16 ring keeps KSPLIT warps on one tile."""
    import torch

    k = 512
    for ks, n, want_grid in ((8, 4096, 128), (4, 4096, 64), (4, 4104, 65), (8, 24576, 132),
                             (16, 4096, 132)):
        gemv, calls = _recording_gemv()
        gemv.ring_int4 = (ks, 8, 1)
        gemv.int4(torch.randn(1, k).bfloat16(), _weight("int4", n, k))
        (name, grid, block, _, smem), = calls
        assert name == V.ring_name("gemv_int4", ks, 8, 0)
        assert grid == (want_grid,) and block == (512,)
        assert smem == 8 * 16 * (32 * 32 + 48) + k * 2
    gemv, calls = _recording_gemv()
    gemv.ring = (8, 8, 1)
    gemv.bf16(torch.randn(1, k).bfloat16(), _weight("bf16", 4096, k))
    (name, grid, block, _, smem), = calls
    assert grid == (132,) and block == (256,) and smem == 8 * 8 * 32 * 32 + k * 2
    with pytest.raises(ValueError, match="Gemv.ring_int4"):
        gemv.ring_int4 = (4, 16, 1)  # a bf16 variant only
    with pytest.raises(ValueError, match="Gemv.ring "):
        gemv.ring = (4, 8, 1)  # an int4 variant only


def test_rstd_refusals():
    """The row-scale RMSNorm takes plain x (int8 / int4 have no rstd keyword): ValueError,
    nothing launched."""
    import pytest
    import torch

    gemv, calls = _recording_gemv()
    x = torch.randn(1, 128).bfloat16()
    with pytest.raises(ValueError, match="row-scale RMSNorm"):
        gemv.bf16(torch.randn(1, 256).bfloat16(), _weight("bf16", 32, 128), rstd=True,
                  swiglu=True)
    with pytest.raises(ValueError, match="row-scale RMSNorm"):
        gemv.bf16(x, _weight("bf16", 32, 128), rstd=True, norm=torch.ones(128).bfloat16())
    assert not calls


def test_swiglu_epilogue_refusals():
    import pytest
    import torch

    gemv, calls = _recording_gemv()
    x = torch.randn(1, 128).bfloat16()
    with pytest.raises(ValueError, match="I % 8 == 0"):  # I = 12
        gemv.bf16(x, _weight("bf16", 24, 128), glu=True)
    with pytest.raises(ValueError, match="no residual"):
        gemv.bf16(x, _weight("bf16", 32, 128), glu=True,
                  residual=torch.zeros(1, 32).bfloat16())
    with pytest.raises(ValueError):
        gemv.bf16(torch.randn(1, 256).bfloat16(), _weight("bf16", 32, 128), glu=True,
                  swiglu=True)
    assert not calls


def test_sums_of_squares_pick_their_kernels():
    """ssq_out (with a residual) is PRO 4 + 32, ssq_in 64 (+ 8 with the SwiGLU epilogue), for
    every kernel and both n-tile counts; the buffers are the last two arguments."""
    import torch

    gemv, calls = _recording_gemv()
    n, k = 256, 384
    for m in (3, 12):
        x = torch.randn(m, k).bfloat16()
        res = torch.zeros(m, n).bfloat16()
        ssq_out = torch.zeros(m, n // 16)
        ssq_in = torch.zeros(m, k // 16)
        for kind in ("bf16", "int8", "int4"):
            w = _weight(kind, n, k)
            run = getattr(gemv, kind)
            for kw, pro, width in (({"residual": res, "ssq_out": ssq_out}, 36, n),
                                   ({"ssq_in": ssq_in}, 64, n),
                                   ({"ssq_in": ssq_in, "glu": True}, 72, n // 2)):
                calls.clear()
                assert run(x, w, eps=1e-6, **kw).shape == (m, width)
                (name, _, _, nargs), = calls
                assert name.startswith(f"{V.KERNELS[V.FILES_OF[kind]]}<{1 if m <= 8 else 2}, ")
                assert name.endswith(f", {pro}>")
                assert nargs == {"bf16": 11, "int8": 12, "int4": 13}[kind]


def test_sums_of_squares_refusals():
    """Wrong buffer shapes, dtypes or combinations: ValueError, nothing launched."""
    import pytest
    import torch

    gemv, calls = _recording_gemv()
    m, n, k = 2, 40, 136  # ceil(40 / 16) = 3, ceil(136 / 16) = 9
    x = torch.randn(m, k).bfloat16()
    w = _weight("bf16", n, k)
    res = torch.zeros(m, n).bfloat16()
    good_out, good_in = torch.zeros(m, 3), torch.zeros(m, 9)
    assert gemv.bf16(x, w, residual=res, ssq_out=good_out).shape == (m, n)
    assert gemv.bf16(x, w, ssq_in=good_in, eps=1e-6).shape == (m, n)
    calls.clear()
    for kw in ({"residual": res, "ssq_out": torch.zeros(m, 2)},  # N / 16 rounded down
               {"residual": res, "ssq_out": torch.zeros(m + 1, 3)},
               {"residual": res, "ssq_out": torch.zeros(m, 3, dtype=torch.float64)},
               {"residual": res, "ssq_out": torch.zeros(3, m).t()},  # not contiguous
               {"ssq_out": good_out},  # no residual
               {"residual": res, "ssq_out": good_out, "norm": torch.ones(k).bfloat16()},
               {"ssq_in": torch.zeros(m, 8)},
               {"ssq_in": good_in, "residual": res},
               {"ssq_in": good_in, "rstd": True},
               {"ssq_in": good_in, "norm": torch.ones(k).bfloat16()}):
        with pytest.raises(ValueError):
            gemv.bf16(x, w, eps=1e-6, **kw)
    with pytest.raises(ValueError):  # the same checks in fused, before any device check
        gemv.fused(x.view(1, m, k), w, ssq_in=torch.zeros(m, 8), eps=1e-6)
    with pytest.raises(ValueError):
        gemv.fused(x, w, residual=res, ssq_out=torch.zeros(m, 2))
    assert not calls


@pytest.mark.parametrize("ring_us,tuned_us,kept", [(101.0, 100.0, True), (109.0, 100.0, True),
                                                  (140.0, 100.0, False)])
def test_settle_ring_keeps_the_ring_only_where_it_streams(ring_us, tuned_us, kept):
    """Gemv.settle_ring: the bf16 ring stays on within 10% of the tuned kernels' time on the
    probe, goes off beyond it; nothing is probed when the ring is off already."""
    gemv, _ = _recording_gemv(V.RING_DEFAULT)
    probes = []
    gemv.probe_ring = lambda: probes.append(1) or (ring_us, tuned_us)
    gemv.settle_ring()
    assert (gemv.ring == V.RING_DEFAULT) == kept and gemv.ring_probe_us == (ring_us, tuned_us)
    gemv.ring = None
    gemv.settle_ring()
    assert len(probes) == 1 and gemv.ring is None


def test_settle_ring_leaves_the_ring_when_the_probe_does_not_fit():
    import torch

    gemv, _ = _recording_gemv(V.RING_DEFAULT)

    def no_memory():
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    gemv.probe_ring = no_memory
    gemv.settle_ring()
    assert gemv.ring == V.RING_DEFAULT


def test_argmax_goes_to_the_bulk_kernels_argmax_epilogue():
    """Gemv.argmax launches gemv_bulk_bf16 with ARGMAX (after plain x or RSTD's row scale) and
    its five extra arguments, one block per SM at most; where the bulk kernel does not take
    the shape (no bulk setting, more than bulk_max_rows rows, an int4 weight, the row scale
    with bulk_rstd off) it launches nothing and says so; a wrong state raises."""
    import torch

    gemv, calls = _recording_gemv(ring=None)
    gemv.supports = lambda x, w, k=None: True  # CPU tensors stand in for device ones
    gemv.bulk = V.BULK_DEFAULT
    k, n = 512, 50000
    w, x = _weight("bf16", n, k), torch.randn(1, k).bfloat16()
    state = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
    out = torch.empty(1, dtype=torch.long)

    def argmax(x, w, rstd, state=state, out=out):
        return gemv.argmax(x, w, rstd=rstd, eps=1e-6, state=state, out=out)

    for rstd, pro in ((False, V.ARGMAX), (True, V.RSTD | V.ARGMAX)):
        calls.clear()
        assert argmax(x, w, rstd)
        (name, grid, block, nargs, smem), = calls
        assert name == V.bulk_name("gemv", *V.BULK_DEFAULT, pro)
        assert grid == (132,) and block == (32 * (V.BULK_DEFAULT[0] + 1),) and nargs == 14
        assert smem == V.bulk_shared_bytes("gemv", *V.BULK_DEFAULT, 1, k)
    calls.clear()
    three = (torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.int32))
    assert not argmax(torch.randn(3, k).bfloat16(), w, False, three, torch.empty(3).long())
    assert not argmax(x, _weight("int4", n, k), False)
    gemv.bulk_rstd = False  # (a MoE model's backend)
    assert not argmax(x, w, True)
    gemv.bulk_rstd, gemv.bulk = True, None
    assert not argmax(x, w, False) and calls == []
    gemv.bulk = V.BULK_DEFAULT
    with pytest.raises(ValueError, match="argmax: keys"):
        argmax(x, w, False, three)
    unpinned = (torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="pinned int64"):
        gemv.argmax(x, w, rstd=False, eps=1e-6, state=state, out=out, host=unpinned)


def test_bulk_takes_the_row_scale_rmsnorm_for_bf16_only():
    """rstd (the norm folded into W, its rstd a row scale) goes to gemv_bulk_bf16's RSTD
    prologues (alone or with the SwiGLU epilogue); int4 launches of it do not exist (fused
    declines rstd for quantized weights) and the bulk int4 kernel does not take it."""
    import torch

    gemv, calls = _recording_gemv(ring=None)
    gemv.bulk = V.BULK_DEFAULT
    k = 512
    for glu, pro in ((False, V.RSTD), (True, V.RSTD | V.GLU)):
        calls.clear()
        gemv.bf16(torch.randn(1, k).bfloat16(), _weight("bf16", 256, k), rstd=True, eps=1e-6,
                  glu=glu)
        (name, *_), = calls
        assert name == V.bulk_name("gemv", *V.BULK_DEFAULT, pro)
    gemv.bulk_int4 = V.BULK_VARIANTS["gemv_int4"][0]
    assert gemv.takes_bulk("gemv", V.RSTD, 1, k) and gemv.takes_bulk("gemv", V.RSTD | V.GLU, 2, k)
    gemv.bulk_rstd = False  # (a MoE model's backend: CupyBackend.gemv)
    assert not gemv.takes_bulk("gemv", V.RSTD, 1, k) and gemv.takes_bulk("gemv", V.PLAIN, 1, k)
    calls.clear()
    gemv.bf16(torch.randn(1, k).bfloat16(), _weight("bf16", 256, k), rstd=True, eps=1e-6)
    assert calls[0][0].startswith("gemv_bf16")  # the tuned kernel's row scale
    gemv.bulk_rstd = True
    assert not gemv.takes_bulk("gemv_int4", V.RSTD, 1, k)
    assert not gemv.takes_bulk("gemv", V.RSTD | V.RESIDUAL, 1, k)
    assert V.persistent_names("gemv_bulk", V.RSTD) == [
        V.bulk_name("gemv", *v, V.RSTD) for v in V.BULK_VARIANTS["gemv"]]


def test_a_launch_may_name_its_own_bulk_setting():
    """fused / bf16 with bulk=(WARPS, S, C): that compiled variant for this launch (its shared
    memory), where the weight kind has a bulk setting at all; none there: the kind's path
    (here the ring's); a setting that is not compiled raises."""
    import torch

    gemv, calls = _recording_gemv(ring=None)
    k, n = 4096, 4096
    x, w = torch.randn(1, k).bfloat16(), _weight("bf16", n, k)
    gemv.bulk = V.BULK_DEFAULT
    for setting in (None, (8, 6, 2048), (16, 4, 2048)):
        calls.clear()
        gemv.bf16(x, w, residual=torch.zeros(1, n).bfloat16(), bulk=setting)
        (name, grid, _, _, smem), = calls
        used = setting or V.BULK_DEFAULT
        assert name == V.bulk_name("gemv", *used, V.RESIDUAL) and grid == (132,)
        assert smem == V.bulk_shared_bytes("gemv", *used, 1, k)
    with pytest.raises(ValueError, match="bulk setting"):
        gemv.bf16(x, w, bulk=(8, 5, 2048))
    gemv.bulk = None  # no bulk kernel for the kind: the launch's setting does not bring one
    calls.clear()
    gemv.bf16(x, w, bulk=(8, 6, 2048))
    assert not calls[0][0].startswith("gemv_bulk")
