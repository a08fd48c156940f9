"""The gemv launch table and variant rules (CPU: no kernel runs here)."""

from __future__ import annotations

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
