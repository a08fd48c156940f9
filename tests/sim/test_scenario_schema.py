"""The Scenario schema: what validates, and what an engineer is told when it does not."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kestrel_sim.scenario import Scenario, json_schema

MINIMAL = {"workload": {"arrivals": {"process": "poisson", "rate": 4.0}}}

FULL = {
    "name": "qwen3-8b-spec-k4",
    "hardware": "h200",
    "model": "qwen3-8b",
    "draft": {"model": "qwen3-0.6b", "device": "gpu"},
    "spec": {"k": 4, "correction": "fused", "acceptance": {"alpha": 0.6}},
    "serving": {"mode": "colocated", "workers": 1, "max_batch": 64, "max_batched_tokens": 8192,
                "prefill_chunk": 2048, "decode_queue": "fifo", "kv_capacity_tokens": 200_000},
    "workload": {"arrivals": {"process": "poisson", "rate": 4.0}, "requests": 2000,
                 "prompt_tokens": {"dist": "fixed", "value": 512},
                 "output_tokens": {"dist": "uniform", "low": 64, "high": 512}, "seed": 0},
    "slo": {"ttft_ms": 500, "tpot_ms": 50},
}


def errors(data, base_dir=None) -> list[tuple[str, str]]:
    """(dotted location, message) of each validation error."""
    with pytest.raises(ValidationError) as info:
        Scenario.load_from_dict(data, base_dir or ".")
    return [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in info.value.errors()]


def test_full_and_minimal_validate():
    sc = Scenario.load_from_dict(FULL)
    assert sc.spec.k == 4 and sc.draft.model == "qwen3-0.6b"
    assert sc.workload.output_tokens.high == 512
    m = Scenario.load_from_dict(MINIMAL)
    assert m.hardware == "h200" and m.model == "qwen3-8b" and m.spec is None
    assert m.serving.max_batch == 64


def test_round_trip_through_json():
    sc = Scenario.load_from_dict(FULL)
    again = Scenario.load_from_dict(json.loads(sc.model_dump_json()))
    assert again == sc


def test_negative_rate_names_the_field():
    bad = {"workload": {"arrivals": {"process": "poisson", "rate": -1}}}
    ((loc, msg),) = errors(bad)
    assert loc == "workload.arrivals.poisson.rate"  # pydantic puts the union tag in the path
    assert "greater than 0" in msg


def test_unknown_key_and_unknown_process():
    (loc, msg), = errors({**MINIMAL, "servng": {}})
    assert loc == "servng" and "Extra inputs" in msg
    (loc, msg), = errors({"workload": {"arrivals": {"process": "poison", "rate": 1}}})
    assert loc == "workload.arrivals" and "'poisson'" in msg


def test_missing_file_is_an_error_naming_the_path(tmp_path):
    bad = {"workload": {"arrivals": {"process": "replay", "file": "arrivals.csv"}}}
    (loc, msg), = errors(bad, tmp_path)
    assert loc == "workload.arrivals.replay.file"
    assert str(tmp_path / "arrivals.csv") in msg


def test_files_resolve_against_base_dir(tmp_path):
    (tmp_path / "acc.txt").write_text("1 2 3\n")
    data = {**FULL, "spec": {"k": 4, "acceptance": {"trace": "acc.txt"}}}
    sc = Scenario.load_from_dict(data, tmp_path)
    assert sc.spec.acceptance.trace == str((tmp_path / "acc.txt").resolve())


def test_model_folder_or_preset(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert Scenario.load_from_dict({**MINIMAL, "model": "m"}, tmp_path).model.endswith("/m")
    (loc, msg), = errors({**MINIMAL, "model": "qwen9"}, tmp_path)
    assert loc == "model" and "qwen3-8b" in msg and "config.json" in msg


def test_unknown_hardware_lists_bundled():
    (loc, msg), = errors({**MINIMAL, "hardware": "h300"})
    assert loc == "hardware" and "h200" in msg and "cpu-xeon" in msg


@pytest.mark.parametrize("patch,where,text", [
    ({"spec": {"k": 4, "acceptance": {}}}, "spec.acceptance", "exactly one of"),
    ({"spec": {"k": 2, "acceptance": {"alpha": 0.5, "per_position": [0.5, 0.5]}}},
     "spec.acceptance", "(got alpha, per_position)"),
    ({"spec": {"k": 4, "acceptance": {"per_position": [0.9, 0.8]}}}, "spec.acceptance",
         "at least k"),
    ({"spec": {"k": 0, "acceptance": {"alpha": 0.5}}}, "spec.k", "greater than or equal to 1"),
    ({"spec": {"k": 2, "acceptance": {"alpha": 1.5}}}, "spec.acceptance.alpha", "less than"),
    ({"draft": None, "spec": {"k": 2, "acceptance": {"alpha": 0.5}}}, "", "draft is missing"),
    ({"serving": {"prefill_workers": 2}}, "serving", "only apply to mode: disaggregated"),
    ({"serving": {"mode": "disaggregated", "workers": 2}}, "serving", "only applies"),
    ({"workload": {"arrivals": {"process": "gamma", "rate": 1, "cv": 0}}},
     "workload.arrivals.gamma.cv", "greater than 0"),
    ({"workload": {"arrivals": {"process": "poisson", "rate": 1},
                   "output_tokens": {"dist": "uniform", "low": 9, "high": 3}}},
     "workload.output_tokens.uniform", "must be >= low"),
    ({"costs": {"table": {"prefill": 1}}}, "", "costs.table lacks draft, verify"),
])
def test_bad_input_messages(patch, where, text):
    data = {**FULL, **patch}
    if data.get("draft") is None:
        data.pop("draft")
    found = errors(data)
    assert any(loc == where and text in msg for loc, msg in found), found


def test_json_schema_for_editors():
    schema = json_schema()
    json.dumps(schema)  # serialisable
    props = schema["properties"]
    assert {"hardware", "model", "draft", "spec", "serving", "workload", "slo", "costs"} <= set(props)
    assert schema.get("additionalProperties") is False
    arrivals = schema["$defs"]["Workload"]["properties"]["arrivals"]
    assert arrivals["discriminator"]["propertyName"] == "process"
