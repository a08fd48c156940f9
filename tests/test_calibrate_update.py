"""`kestrel calibrate --update BASE` on the CPU with tiny models: a part of the grid measured
again goes into BASE in place of BASE's rows of the same (stage, device), the rest of BASE
kept; a missing or invalid BASE fails before anything is built, and a BASE of another setup
is refused with this run's measurements kept beside --out."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_models
from typer.testing import CliRunner

from kestrel_cli.app import app
from kestrel_sim.errors import ConfigError
from kestrel_sim.profile import Profile

runner = CliRunner()
TIMING = "timing: {warmup: 1, repeats: 3, cpu_warmup: 1, cpu_repeats: 3}\n"
BASE_GRID = "name: base\n" + TIMING + (
    "decode: {batches: [1], contexts: [8]}\n"
    "draft:\n  cpu: {batches: [1], contexts: [8], new_tokens: [1]}\n")
PART_GRID = "name: part\n" + TIMING + (
    "draft:\n  cpu: {batches: [1, 2], contexts: [16], new_tokens: [1]}\n")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: tiny_models.build(name, tmp_path_factory.mktemp(name))
            for name in ("tied", "untied")}


def calibrate(folders, grid_text: str, out, *extra: str):
    grid = out.with_name(f"{out.stem}-grid.yaml")
    grid.write_text(grid_text)
    return runner.invoke(app, ["calibrate", "--model", str(folders["tied"]), "--draft",
                               str(folders["untied"]), "--device", "cpu", "--grid", str(grid),
                               "--out", str(out), *extra])


@pytest.fixture(scope="module")
def base(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "base.json"
    result = calibrate(folders, BASE_GRID, out, "--commit", "abc")
    assert result.exit_code == 0, result.output
    return out


def test_update_replaces_the_rows_of_the_stages_measured_again(folders, base, tmp_path):
    path = tmp_path / "profile.json"
    path.write_bytes(base.read_bytes())
    result = calibrate(folders, PART_GRID, path, "--commit", "def", "--update", str(path))
    assert result.exit_code == 0, result.output
    old, new = Profile.load(base), Profile.load(path)
    assert [(m.batch, m.context) for m in new.rows("draft", "cpu")] == [(1, 16), (2, 16)]
    assert new.rows("decode", "cpu") == old.rows("decode", "cpu")  # not measured again: kept
    # the part measured none of the target's steps, but its fingerprint still names it
    assert new.fingerprint.git_commit == "abc" and new.fingerprint.grid == "base+part"
    assert [(p.git_commit, p.grid) for p in new.parts] == [("def", "part")]
    assert f"wrote {path} (3 measurements)" in result.output


@pytest.mark.parametrize("text,expected", [
    (None, "cannot read profile"), ("{", "invalid JSON"),
    ('{"fingerprint": {}}', "does not validate"),
])
def test_a_missing_or_invalid_base_fails_before_measuring(folders, tmp_path, text, expected):
    path = tmp_path / "base.json"
    if text is not None:
        path.write_text(text)
    out = tmp_path / "out.json"
    result = calibrate(folders, PART_GRID, out, "--update", str(path))
    error = str(result.exception)  # kestrel's main prints it and exits 2
    assert isinstance(result.exception, ConfigError), result.output
    assert error.startswith("--update: ") and str(path) in error and expected in error
    assert "calibrating" not in result.output and not out.exists()  # nothing was measured


def test_a_base_of_another_setup_is_refused_and_the_run_kept(folders, base, tmp_path):
    other = json.loads(base.read_text())
    other["fingerprint"]["dtype"] = "float16"
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(other))
    result = calibrate(folders, PART_GRID, path, "--update", str(path))
    assert isinstance(result.exception, ConfigError), result.output
    assert "different setups (dtype: 'float16' vs 'float32')" in str(result.exception)
    kept = tmp_path / "profile.part.json"
    assert str(result.exception).endswith(f"this run's measurements are in {kept}")
    assert len(Profile.load(kept).rows("draft", "cpu")) == 2
    assert json.loads(path.read_text()) == other  # BASE untouched


def test_update_with_ray_is_refused(folders, tmp_path):
    result = calibrate(folders, PART_GRID, tmp_path / "out.json", "--update",
                       str(tmp_path / "base.json"), "--ray", "ray://head:10001")
    assert "--update with --ray" in str(result.exception)
