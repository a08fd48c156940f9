"""The scenario's quant prices the weights the roofline reads, and a profile measured with
other weights is refused."""

from __future__ import annotations

import pytest

from kestrel_sim import simulate
from kestrel_sim.costs.work import bytes_per_param
from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import Scenario

BASE = {"model": "qwen3-8b", "costs": {"roofline": {}},
        "workload": {"arrivals": {"process": "poisson", "rate": 2}, "requests": 30,
                     "prompt_tokens": {"dist": "fixed", "value": 256},
                     "output_tokens": {"dist": "fixed", "value": 64}}}


def test_quantized_weights_decode_faster_on_the_roofline():
    tpot = {q: simulate(Scenario.load_from_dict(dict(BASE, quant=q))).metrics.median_tpot_ms
            for q in ("none", "int8", "int4")}
    assert tpot["int4"] < tpot["int8"] < tpot["none"]


def test_a_mixed_quantization_averages_its_layers():
    assert bytes_per_param("bfloat16", "int4-last-14", 28) == pytest.approx(0.75)
    assert bytes_per_param("bfloat16", "int4-last-0", 28) == 1.0
    assert bytes_per_param("bfloat16", "none") == 2.0


def test_a_profile_of_other_weights_is_refused():
    sc = Scenario.load_from_dict(dict(BASE, quant="int4", costs={
        "profile": "calibration/profiles/qwen3-8b_h200.json"}))
    with pytest.raises(ConfigError, match="quant 'none'.*quant is 'int4'"):
        simulate(sc)


def test_a_roofline_calibrated_from_other_weights_is_refused():
    sc = Scenario.load_from_dict(dict(BASE, quant="int4", costs={"roofline": {
        "calibrated_from": "calibration/profiles/qwen3-8b_h200.json"}}))
    with pytest.raises(ConfigError, match="quant 'none'.*quant is 'int4'"):
        simulate(sc)
