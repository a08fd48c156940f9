"""bench/probes/ptx_diff.py: entries compared up to the names nvcc derives from elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probes"))

from ptx_diff import entries, verdict

ENTRY = """.visible .entry k_{tag}(
\t.param .u64 p
)
{{
\t.shared .align 4 .b8 _ZZ4implILi{t}EEvPfE5s_acc[64];
\tmov.u32 %r{reg}, 1;
\t@%p1 bra $L__BB{fn}_2;
$L__BB{fn}_2:
\tst.shared.f32 [_ZZ4implILi{t}EEvPfE5s_acc], %f1;
\tret;
}}
"""


def test_template_names_and_label_numbers_do_not_count(tmp_path):
    a, b = tmp_path / "a.ptx", tmp_path / "b.ptx"
    a.write_text(ENTRY.format(tag="x", t=4, reg=1, fn=3))
    b.write_text(ENTRY.format(tag="x", t=5, reg=1, fn=9) + ENTRY.format(tag="y", t=4, reg=1, fn=1))
    before, after = entries(str(a)), entries(str(b))
    assert set(after) == {"k_x", "k_y"} and "SHARED_s_acc" in after["k_x"]
    assert verdict(before["k_x"], after["k_x"]) == "identical"


def test_register_numbers_then_real_changes():
    base = ENTRY.format(tag="x", t=4, reg=1, fn=3)
    assert verdict(base, ENTRY.format(tag="x", t=4, reg=7, fn=3)) == "same up to register numbers"
    assert verdict(base, base.replace("mov.u32 %r1, 1", "mov.u32 %r1, 2")) == "DIFFERENT"
