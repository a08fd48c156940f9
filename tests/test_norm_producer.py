"""CupyBackend.norm_row_scale "producer" bookkeeping (CPU: the gemv is a recording fake).

linear_add's gemv writes its output's sums of squares into a kept buffer per (rows, width);
the norm op right after it, on exactly that output, passes the buffer to its gemv as ssq_in.
Anything else (another tensor, a second norm op, a new forward, a norm that is not a unit
one, another mode, too many rows) gets no buffer and takes the existing path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kestrel_rt.backend.cupy_backend import CupyBackend

H, I, V = 32, 48, 64  # hidden, intermediate, vocab


class FakeGemv:
    """Records fused() calls (weight name and the keywords set) and linear() calls (no
    keywords), returning fresh results."""

    def __init__(self, widths: dict[str, int]):
        self.calls: list[tuple[str, dict]] = []
        self.widths = widths

    def fused(self, x, w, **kw):
        self.calls.append((w, {k: v for k, v in kw.items() if v is not None and v is not False}))
        n = self.widths[w] // (2 if kw.get("glu") else 1)
        return torch.zeros(*x.shape[:-1], n, dtype=torch.bfloat16)

    def linear(self, x, w):  # the unfused path (after the rmsnorm kernel)
        self.calls.append((w, {}))
        return torch.zeros(*x.shape[:-1], self.widths[w], dtype=torch.bfloat16)


def _backend(mode: str):
    be = CupyBackend.__new__(CupyBackend)  # no device: the op logic only
    be.norm_row_scale = mode
    be._unit_norms = {"layers.0.input_norm", "layers.0.post_norm", "norm"}
    be._ssq_bufs, be._ssq_last, be.ssq_consumed = {}, None, 0
    be.glu_epilogue, be.fuse_prologues, be.ring_norm = True, False, False
    be.kind_bulk = {}  # the Gemv's own bulk settings
    be.shape = SimpleNamespace(rms_norm_eps=1e-6)
    embed = torch.randn(V, H).bfloat16()
    be.weight = lambda name: embed if name == "embed" else name  # the fake takes names
    fake = FakeGemv({"layers.0.o": H, "layers.0.down": H, "layers.0.qkv": 3 * H,
                     "layers.0.gate_up": 2 * I, "lm_head": V})
    be.gemv = lambda: fake
    be.rms_norm = lambda x, name: x  # the rmsnorm kernel's place (fallback)
    return be, fake


def _step(be, rows: int = 2):
    x = be.embed(torch.zeros(1, rows, dtype=torch.long))  # [1, rows, H]
    x = be.linear_add(torch.zeros(1, rows, H, dtype=torch.bfloat16), "layers.0.o", x)
    return x


def test_the_norm_after_linear_add_reads_its_sums_of_squares():
    be, fake = _backend("producer")
    x = _step(be)
    (name, kw), = fake.calls
    assert name == "layers.0.o" and kw["ssq_out"].shape == (2, H // 16)
    buf = kw["ssq_out"]
    assert be._ssq_bufs == {(2, H): buf} and buf.dtype == torch.float32
    act = be.norm_linear_swiglu(x, "layers.0.post_norm", "layers.0.gate_up")
    assert act.shape == (1, 2, I) and be.ssq_consumed == 1
    name, kw = fake.calls[-1]
    assert name == "layers.0.gate_up" and kw["ssq_in"] is buf and kw["glu"]
    assert kw["eps"] == 1e-6 and "rstd" not in kw
    # the down projection writes the same buffer again (one per (rows, width)), and the
    # next norm_linear reads it
    x = be.linear_add(act, "layers.0.down", x)
    assert fake.calls[-1][1]["ssq_out"] is buf
    be.norm_linear(x, "norm", "lm_head")
    assert fake.calls[-1][1]["ssq_in"] is buf and be.ssq_consumed == 2


def test_no_sums_of_squares_for_anything_else():
    be, fake = _backend("producer")
    x = _step(be)
    be.norm_linear(x.clone(), "layers.0.input_norm", "layers.0.qkv")  # another tensor
    assert "ssq_in" not in fake.calls[-1][1]
    be.norm_linear(x, "layers.0.input_norm", "layers.0.qkv")  # taken by the op before
    assert "ssq_in" not in fake.calls[-1][1]
    x = _step(be)
    _step(be, rows=1)  # a new forward (embed) and another linear_add in between
    be.norm_linear(x, "layers.0.input_norm", "layers.0.qkv")
    assert "ssq_in" not in fake.calls[-1][1]
    x = _step(be)
    be._unit_norms.discard("layers.0.input_norm")  # a norm with a real weight
    be.norm_linear(x, "layers.0.input_norm", "layers.0.qkv")
    assert "ssq_in" not in fake.calls[-1][1] and be.ssq_consumed == 0
    x = be.embed(torch.zeros(1, 17, dtype=torch.long))  # more rows than the gemvs take
    be.linear_add(torch.zeros(1, 17, H, dtype=torch.bfloat16), "layers.0.o", x)
    assert "ssq_out" not in fake.calls[-1][1] and be._ssq_last is None


@pytest.mark.parametrize("mode", ["all", "moe", "none"])
def test_other_modes_write_no_sums_of_squares(mode):
    be, fake = _backend(mode)
    x = _step(be)
    assert "ssq_out" not in fake.calls[-1][1] and not be._ssq_bufs
    be.norm_linear(x, "layers.0.input_norm", "layers.0.qkv")
    assert "ssq_in" not in fake.calls[-1][1]
    assert fake.calls[-1][1].get("rstd", False) == (mode == "all")


def test_the_o_projection_takes_the_deeper_ring_where_it_has_more_tiles_than_sms():
    """CupyBackend.kind_bulk None: the o projection's launches on one row of x take
    BULK_AFTER_ATTENTION where its weight has more 16-row tiles than the GPU has SMs (qwen3-8b
    on 132), not elsewhere (qwen3-30b-a3b, qwen3-0.6b), not at two rows and no other kind; a
    kind_bulk given (even empty) replaces it, at any rows."""
    from kestrel_rt.cuda.gemv_variants import BULK_AFTER_ATTENTION
    from kestrel_sim.models import preset

    be = CupyBackend.__new__(CupyBackend)
    be.num_sms, be.kind_bulk = 132, None
    bf16 = torch.zeros(16, 128, dtype=torch.bfloat16)
    be.weight = lambda name: bf16
    one, two = torch.zeros(1, 1, 4096), torch.zeros(2, 1, 4096)
    for name, deep in (("qwen3-8b", True), ("qwen3-30b-a3b", False), ("qwen3-0.6b", False)):
        be.shape = preset(name)
        assert be._bulk_of("layers.3.o", one) == (BULK_AFTER_ATTENTION if deep else None)
        assert be._bulk_of("layers.3.o", two) is None
        assert be._bulk_of("layers.3.down", one) is None and be._bulk_of("lm_head", one) is None
    be.kind_bulk = {}
    assert be._bulk_of("layers.3.o", one) is None
    be.kind_bulk = {"down": (16, 4, 2048)}
    assert be._bulk_of("layers.0.down", two) == (16, 4, 2048)
    assert be._bulk_of("layers.0.o", one) is None


def test_kind_bulk_leaves_quantized_weights_to_their_gemv_setting():
    """kind_bulk names bf16 bulk variants: an int8 / int4 weight's launch gets None (its
    Gemv's own setting, e.g. Gemv.bulk_int4, whose compiled variants differ), by default and
    when given."""
    from kestrel_rt.quant_weights import Int4Weight, Int8Weight
    from kestrel_sim.models import preset

    be = CupyBackend.__new__(CupyBackend)
    be.num_sms, be.kind_bulk, be.shape = 132, None, preset("qwen3-8b")
    one = torch.zeros(1, 1, 4096)
    w = torch.randn(16, 128)
    for quantized in (Int4Weight.from_float(w), Int8Weight.from_float(w)):
        be.weight = lambda name, q=quantized: q
        be.kind_bulk = None
        assert be._bulk_of("layers.3.o", one) is None
        be.kind_bulk = {"o": (8, 6, 2048)}
        assert be._bulk_of("layers.3.o", one) is None
