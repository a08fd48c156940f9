"""Scenario loading: every problem names the file, line and key path; overrides apply."""

from __future__ import annotations

import textwrap

import pytest

from kestrel_sim.errors import ConfigError
from kestrel_sim.scenario import load_scenario
from kestrel_sim.yamlio import parse_override, read_yaml

GOOD = """\
name: t
model: qwen3-8b
draft: {model: qwen3-0.6b, device: gpu}
spec:
  k: 4
  correction: fused
  acceptance: {alpha: 0.6}
workload:
  arrivals: {process: poisson, rate: 4.0}
  requests: 50
  output_tokens: {dist: uniform, low: 8, high: 32}
slo: {ttft_ms: 500, tpot_ms: 50}
"""


def _write(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def _error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_scenario(path, overrides)
    return str(info.value)


def test_good_scenario_loads_and_overrides_apply(tmp_path):
    path = _write(tmp_path, GOOD)
    s = load_scenario(path)
    assert s.spec.k == 4 and s.workload.arrivals.rate == 4.0
    s = load_scenario(path, ["spec.k=8", "workload.arrivals.rate=2", "spec.correction=separate"])
    assert s.spec.k == 8 and s.workload.arrivals.rate == 2.0
    assert s.spec.correction == "separate"


def test_unknown_key_names_key_line_and_allowed_keys(tmp_path):
    path = _write(tmp_path, GOOD + "serving:\n  max_bach: 3\n")
    msg = _error(path)
    assert f"{path}:14: serving.max_bach: unknown key 'max_bach'" in msg
    assert "max_batch" in msg and "prefill_chunk" in msg


def test_wrong_type_says_what_was_expected(tmp_path):
    path = _write(tmp_path, GOOD.replace("requests: 50", "requests: many"))
    msg = _error(path)
    assert f"{path}:10: workload.requests: expected an integer (got 'many')" in msg


def test_negative_rate_names_path_and_line(tmp_path):
    path = _write(tmp_path, GOOD.replace("rate: 4.0", "rate: -1"))
    msg = _error(path)
    assert f"{path}:9: workload.arrivals.rate: must be > 0" in msg
    assert "(got -1)" in msg


def test_missing_referenced_file(tmp_path):
    text = GOOD.replace("acceptance: {alpha: 0.6}", "acceptance: {trace: accepted.txt}")
    msg = _error(_write(tmp_path, text))
    assert ":7: spec.acceptance.trace:" in msg
    assert "accepted.txt" in msg and "not found" in msg


def test_referenced_file_resolves_against_scenario_folder(tmp_path):
    (tmp_path / "accepted.txt").write_text("0 1 2 3 4\n")
    text = GOOD.replace("acceptance: {alpha: 0.6}", "acceptance: {trace: accepted.txt}")
    s = load_scenario(_write(tmp_path, text))
    assert s.spec.acceptance.trace == str((tmp_path / "accepted.txt").resolve())


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, GOOD.replace("requests: 50", "requests: [50"))
    msg = _error(path)
    assert str(path) in msg and "invalid YAML" in msg
    assert f"{path}:11: invalid YAML" in msg  # where the parser noticed
    assert "started at line 10" in msg  # where the bad flow sequence began


def test_bad_discriminator_lists_choices(tmp_path):
    msg = _error(_write(tmp_path, GOOD.replace("process: poisson", "process: poison")))
    assert ":9: workload.arrivals.process: must be one of" in msg
    assert "'gamma'" in msg and "(got 'poison')" in msg


def test_several_problems_are_all_listed(tmp_path):
    text = GOOD.replace("rate: 4.0", "rate: 0").replace("requests: 50", "requests: -2")
    msg = _error(_write(tmp_path, text))
    assert "2 problems" in msg
    assert "workload.arrivals.rate" in msg and "workload.requests" in msg


def test_override_errors_point_at_the_override(tmp_path):
    path = _write(tmp_path, GOOD)
    msg = _error(path, ["spec.k=0"])
    assert "--set spec.k=0: spec.k: must be >= 1 (got 0)" in msg
    msg = _error(path, ["serving.nope=1"])
    assert "--set serving.nope=1: serving.nope: unknown key 'nope'" in msg


def test_missing_key_under_a_mapping_an_override_made_points_at_the_override(tmp_path):
    path = _write(tmp_path, "name: x\nworkload:\n  arrivals: {process: poisson, rate: 1}\n")
    msg = _error(path, ["spec.k=2"])  # no spec in the file: the override made it
    assert "--set spec.k=2: spec.acceptance: missing required key" in msg


def test_fractional_integer_says_an_integer_is_expected(tmp_path):
    msg = _error(_write(tmp_path, GOOD), ["spec.k=2.5"])
    assert "--set spec.k=2.5: spec.k: expected an integer (got 2.5)" in msg


def test_malformed_override():
    with pytest.raises(ConfigError, match="KEY.PATH=VALUE"):
        parse_override("spec.k")


def test_override_values_are_yaml():
    assert parse_override("a.b=[1, 2]") == (("a", "b"), [1, 2])
    assert parse_override("a.0.c=true") == (("a", 0, "c"), True)
    assert parse_override("x=fused") == (("x",), "fused")


def test_read_yaml_records_lines(tmp_path):
    _, located = read_yaml(_write(tmp_path, GOOD))
    assert located.lines[("workload", "arrivals", "rate")] == 9
    assert located.lines[("spec", "acceptance", "alpha")] == 7


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_scenario(_write(tmp_path, "- 1\n- 2\n"))
