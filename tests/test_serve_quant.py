"""A scenario's quant / draft.quant build quantized models on the runtime, and
spec.acceptance.on_hardware chooses controlled or organic acceptance (CPU, tiny models)."""

from __future__ import annotations

import pytest
from test_serve_spec import MIXED, spec_scenario
from tiny_models import build

from kestrel_rt.quant_weights import weight_kind
from kestrel_rt.serve import build as serve_build
from kestrel_rt.serve import serve


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_quant")
    return {"same": build("tied", root / "tied"), "other": build("tied", root / "other", seed=1)}


def test_quant_keys_reach_the_models(folders, monkeypatch):
    built = []
    real = serve_build.build_model

    def spy(name, device, dtype=None, quant="none"):
        model = real(name, device, dtype, quant)
        built.append((quant, {weight_kind(model.backend.weight("layers.0.qkv"))}))
        return model

    monkeypatch.setattr(serve_build, "build_model", spy)
    sc = spec_scenario(folders, "other", MIXED, requests=3)
    sc = sc.model_copy(update={"quant": "int8",
                               "draft": sc.draft.model_copy(update={"quant": "int8"})})
    served = serve(sc, "cpu")
    assert all(r.finish is not None for r in served.trace.requests)
    assert built == [("int8", {"int8"}), ("int8", {"int8"})]


@pytest.mark.parametrize("mode,controlled", [("auto", False), ("controlled", True),
                                             ("organic", False)])
def test_on_hardware_chooses_the_acceptance(folders, mode, controlled):
    sc = spec_scenario(folders, "other", MIXED, requests=3,
                       acceptance={"alpha": 0.9, "on_hardware": mode})
    served = serve(sc, "cpu")
    assert served.trace.meta["acceptance_controlled"] is controlled


def test_metrics_say_where_the_accepted_lengths_came_from(folders):
    from kestrel_sim import simulate
    from kestrel_sim.metrics import compute_metrics

    sc = spec_scenario(folders, "other", MIXED, requests=3,
                       acceptance={"alpha": 0.9, "on_hardware": "controlled"})
    assert compute_metrics(serve(sc, "cpu").trace).acceptance_source == "controlled"
    organic = sc.model_copy(update={"spec": sc.spec.model_copy(update={
        "acceptance": sc.spec.acceptance.model_copy(update={"on_hardware": "organic"})})})
    assert compute_metrics(serve(organic, "cpu").trace).acceptance_source == "organic"
    assert simulate(sc).metrics.acceptance_source == "simulated"
    plain = sc.model_copy(update={"draft": None, "spec": None})
    assert simulate(plain).metrics.acceptance_source is None
