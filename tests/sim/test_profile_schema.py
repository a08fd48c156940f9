"""The Profile schema (version 2): fields per stage, fingerprints, merging, replacing a
part's rows, version 1 files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel_sim.costs.shape import shape_hash
from kestrel_sim.errors import ConfigError
from kestrel_sim.measured_acceptance import MeasuredAcceptance
from kestrel_sim.models import preset
from kestrel_sim.profile import Fingerprint, Measurement, Profile
from kestrel_sim.runtime_info import RuntimeInfo

BUNDLED = Path(__file__).resolve().parents[2] / "calibration" / "profiles"
DATA = Path(__file__).resolve().parent / "data"  # qwen3-8b_h200_v1.json: the 2026-12-01 file
FP = {"device": "NVIDIA H200", "model": "qwen3-8b", "draft_model": "qwen3-0.6b",
      "git_commit": "abc", "date": "2026-12-01"}


def row(stage="decode", **kw):
    return {"stage": stage, "batch": 1, "tokens_per_seq": 1, "context": 128, "ms": 4.0, **kw}


def profile(rows=None, **fp) -> Profile:
    return Profile.model_validate({"fingerprint": {**FP, **fp},
                                   "measurements": rows or [row()]})


def test_shape_hash_is_stable_and_sees_only_cost_fields():
    h = shape_hash(preset("qwen3-8b"))
    assert len(h) == 16 and h == shape_hash(preset("qwen3-8b").model_copy())
    renamed = preset("qwen3-8b").model_copy(update={"name": "mine", "rope_theta": 1.0})
    assert shape_hash(renamed) == h  # neither a name nor rope changes a step's cost
    wider = preset("qwen3-8b").model_copy(update={"intermediate_size": 14336})
    assert shape_hash(wider) != h
    assert len({shape_hash(preset(n)) for n in ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")}) == 3


@pytest.mark.parametrize("path", [DATA / "qwen3-8b_h200_v1.json",
                                  BUNDLED / "qwen3-0.6b_h200.json"])
def test_version_1_profiles_load_as_version_2(path, tmp_path):
    assert "schema_version" not in json.loads(path.read_text())  # written as version 1
    p = Profile.load(path)
    fp = p.fingerprint
    assert p.schema_version == 2 and fp.quant == "none"
    assert fp.model_shape_hash == shape_hash(preset(fp.model))
    if fp.draft_model:
        assert fp.draft_shape_hash == shape_hash(preset(fp.draft_model))
        assert fp.draft_device == "gpu"
    p.save(tmp_path / path.name)  # converted: load + save
    again = json.loads((tmp_path / path.name).read_text())
    assert again["schema_version"] == 2 and again["fingerprint"]["model_shape_hash"]
    assert Profile.load(tmp_path / path.name) == p


def test_the_bundled_qwen3_8b_profile_is_a_calibration_on_an_h200():
    p = Profile.load(BUNDLED / "qwen3-8b_h200.json")
    fp = p.fingerprint
    # the default grid, its CPU draft's rows re-measured in rounds (Profile.replace_rows)
    assert p.schema_version == 2 and fp.device == "NVIDIA H200" and fp.grid in (
        "default", "default+draft-cpu-rounds")
    assert fp.model_shape_hash == shape_hash(preset("qwen3-8b"))
    stages = {m.stage for m in p.measurements}
    assert {"decode", "verify", "prefill", "mixed", "draft", "correction", "kv_transfer",
            "overlap"} <= stages


def test_every_stage_reads_its_fields():
    rows = [row(), row("verify", tokens_per_seq=5), row("prefill", tokens_per_seq=512, context=0),
            row("mixed", batch=16, chunk_tokens=1024, chunk_context=2048, p10=3.9, p90=4.2),
            row("kv_transfer", tokens_per_seq=4096, context=0, bytes=603979776),
            row("draft", device="cpu")]
    p = profile(rows)
    assert p.stages() == {"decode", "verify", "prefill", "mixed", "kv_transfer", "draft"}
    mixed = p.rows("mixed")[0]
    assert mixed.chunk == (1, 1024.0, 2048.0)  # one prompt unless chunk_batch says more
    assert p.rows("draft", "cpu") and not p.rows("draft", "gpu")


@pytest.mark.parametrize("bad,message", [
    (row("mixed"), "a mixed step needs chunk_tokens"),
    (row(chunk_tokens=256), "chunk_tokens only apply to stage mixed"),
    (row("kv_transfer"), "bytes is needed by stage kv_transfer"),
    (row(bytes=10), "bytes is needed by stage kv_transfer, and only by it"),
    (row(p10=5.0), "expected p10 <= ms <= p90"),
    (row(device="tpu"), "Input should be 'gpu' or 'cpu'"),
])
def test_a_measurement_of_the_wrong_shape_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        Measurement.model_validate(bad)


def test_a_model_that_is_not_a_preset_needs_its_shape_hash():
    with pytest.raises(ValueError, match="model_shape_hash is needed"):
        Fingerprint(device="NVIDIA H200", model="my-finetune")
    fp = Fingerprint(device="NVIDIA H200", model="my-finetune", model_shape_hash="0123")
    assert fp.model_shape_hash == "0123" and fp.draft_device is None


def test_load_names_the_file_line_and_key(tmp_path):
    data = json.loads((BUNDLED / "qwen3-8b_h200.json").read_text())
    data["measurements"][2]["stage"] = "mixed"
    data["fingerprint"]["quant"] = "int3"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data, indent=1))
    text = path.read_text().splitlines()
    quant_line = next(i for i, t in enumerate(text, 1) if '"quant"' in t)
    with pytest.raises(ConfigError) as err:
        Profile.load(path)
    msg = str(err.value)
    assert f"p.json:{quant_line}: fingerprint.quant: must be one of" in msg
    assert "measurements.2: a mixed step needs chunk_tokens" in msg
    assert "2 problems" in msg


def test_merge_joins_grid_parts_of_one_setup():
    a = profile([row()], grid="default")
    b = profile([row(batch=2), row("verify", tokens_per_seq=5)], grid="default")
    merged = a.merge(b)
    assert len(merged.measurements) == 3 and merged.fingerprint == a.fingerprint
    assert merged.parts == []


@pytest.mark.parametrize("field,value", [
    ("device", "NVIDIA H100"), ("model", "qwen3-14b"), ("dtype", "float16"), ("quant", "int4"),
    ("draft_model", "qwen3-1.7b"), ("draft_device", "cpu"), ("backend", "torch"),
    ("options", {"graphs": False}),
])
def test_merge_refuses_another_setup(field, value):
    with pytest.raises(ConfigError, match=f"different setups \\({field}: "):
        profile().merge(profile(**{field: value}))


def test_merge_refuses_another_host_cpu_only_with_cpu_rows():
    gpu = profile(host_cpu="Xeon A").merge(profile(host_cpu="Xeon B"))
    assert len(gpu.measurements) == 2
    with pytest.raises(ConfigError, match="host_cpu"):
        profile([row("draft", device="cpu")], host_cpu="Xeon A").merge(profile(host_cpu="Xeon B"))


def test_merge_of_another_run_needs_the_flag_and_keeps_its_fingerprint():
    old = profile(git_commit="abc", date="2026-12-01")
    later = profile([row(batch=4)], date="2026-12-02")  # the same code, measured later
    assert [p.date for p in old.merge(later).parts] == ["2026-12-02"]
    new = profile([row(batch=4)], git_commit="def", torch="2.13", date="2026-12-02")
    with pytest.raises(ConfigError, match="git_commit: 'abc' vs 'def'; torch: None vs '2.13'"):
        old.merge(new)
    merged = old.merge(new, allow_version_drift=True)
    assert merged.fingerprint.git_commit == "abc"
    assert [p.git_commit for p in merged.parts] == ["def"]
    assert len(merged.measurements) == 2


# -- replacing rows: a part of the grid measured again -------------------------------------
def test_replace_rows_takes_the_measured_pairs_from_the_other():
    base = profile([row(), row("draft", device="cpu"), row("draft", batch=4, device="cpu"),
                    row("draft", ms=2.0)], grid="default", options={"draft@cpu": {"a": 1}})
    part = profile([row("draft", batch=2, device="cpu", ms=9.0)], grid="draft-cpu",
                   git_commit="def", torch="2.13", date="2026-12-03", draft_device="cpu",
                   options={"spec@cpu": {"b": 2}, "draft@cpu": {"a": 3}})
    new = base.replace_rows(part)
    assert new.rows("draft", "cpu") == part.measurements  # both of base's CPU rows went
    assert [m for m in new.measurements if m.device == "gpu"] == base.rows("decode") + base.rows(
        "draft")  # the GPU draft's rows stay: another (stage, device) pair
    fp = new.fingerprint
    assert (fp.git_commit, fp.date, fp.draft_device, fp.grid) == (
        "abc", "2026-12-01", "gpu", "default+draft-cpu")
    assert fp.options == {"draft@cpu": {"a": 3}, "spec@cpu": {"b": 2}}  # the part's win
    assert new.parts == [part.fingerprint]
    assert base.replace_rows(new).parts == [new.fingerprint, part.fingerprint]  # and its parts


def test_replace_rows_keeps_the_acceptance_unless_there_is_none():
    def block(lengths):
        return MeasuredAcceptance.from_lengths(
            lengths, 2, draft_model="qwen3-0.6b", draft_quant="none", draft_device="gpu",
            device="NVIDIA H200", dtype="bfloat16", backend="cupy", prompts=1,
            prompt_tokens=16, rounds=3)
    mine, theirs = block([0, 1, 2]), block([2, 2, 2])
    with_mine = profile().model_copy(update={"acceptance": mine})
    with_theirs = profile().model_copy(update={"acceptance": theirs})
    assert with_mine.replace_rows(with_theirs).acceptance == mine
    assert profile().replace_rows(with_theirs).acceptance == theirs


@pytest.mark.parametrize("field,value", [
    ("device", "NVIDIA H100"), ("model", "qwen3-14b"), ("dtype", "float16"), ("quant", "int4"),
    ("draft_model", "qwen3-1.7b"), ("draft_quant", "int8"), ("backend", "torch"),
])
def test_replace_rows_refuses_another_setup_naming_the_field_and_values(field, value):
    base = profile(backend="cupy")
    with pytest.raises(ConfigError) as err:
        base.replace_rows(profile(**{field: value}))
    assert (f"cannot replace rows between profiles of different setups ({field}: "
            f"{getattr(base.fingerprint, field)!r} vs {value!r}") in str(err.value)


def test_replace_rows_refuses_another_host_cpu_only_for_cpu_rows():
    base = profile([row(), row("draft", device="cpu")], host_cpu="Xeon A")
    assert len(base.replace_rows(profile([row(batch=2)], host_cpu="Xeon B")).measurements) == 2
    with pytest.raises(ConfigError, match="host_cpu: 'Xeon A' vs 'Xeon B'"):
        base.replace_rows(profile([row("draft", device="cpu")], host_cpu="Xeon B"))


def test_replace_rows_refuses_another_runtime():
    padded = profile().model_copy(update={"runtime": RuntimeInfo(batch_buckets=[1, 2, 4])})
    with pytest.raises(ConfigError, match="cannot replace rows between profiles whose "
                       "runtimes ran steps differently \\(runtime: None vs batch_buckets"):
        profile().replace_rows(padded)
