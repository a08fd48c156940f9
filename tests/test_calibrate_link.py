"""The KV link in calibration: kv_transfer rows name the device pair they measured
(Measurement.link), a grid measures the copy to a second GPU where one is given (skipped
with a note otherwise), and the simulator's link is fitted to the rows between devices
where a profile has them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from calibration.grid import Grid, Point, expand
from calibration.measure import Record
from calibration.plan import Request, make_plan, peer_gpu
from calibration.record import to_measurement
from kestrel_sim.costs.profile import ProfileFits
from kestrel_sim.profile import Measurement, Profile

GRID = {"decode": {"batches": [1], "contexts": [16]}, "kv_transfer": {"tokens": [64, 256]}}


def transfer(n: int, ms: float, link: str | None) -> Measurement:
    return Measurement(stage="kv_transfer", batch=1, tokens_per_seq=n, bytes=n * 1000, ms=ms,
                       link=link)


def test_a_measurement_names_its_pair_only_for_kv_transfer():
    assert transfer(8, 0.1, "cuda:0->cuda:1").between_devices
    assert not transfer(8, 0.1, "cuda:0->cuda:0").between_devices
    assert not transfer(8, 0.1, None).between_devices  # older files: within the device
    with pytest.raises(ValidationError, match="link only applies to stage kv_transfer"):
        Measurement(stage="decode", batch=1, tokens_per_seq=1, ms=1.0, link="cuda:0->cuda:1")
    with pytest.raises(ValidationError, match="link"):
        transfer(8, 0.1, "cuda:0 to cuda:1")


def test_the_link_is_fitted_to_the_rows_between_devices_where_there_are_some():
    # within: 1 us + 100 GB/s; between: 5 us + 50 GB/s (bytes = n * 1000)
    within = [transfer(n, 1e-3 + n * 1000 / 100e9 * 1e3, "cuda:0->cuda:0") for n in (64, 4096)]
    apart = [transfer(n, 5e-3 + n * 1000 / 50e9 * 1e3, "cuda:0->cuda:1") for n in (64, 4096)]
    profile = Profile(fingerprint={"device": "NVIDIA H200", "model": "qwen3-0.6b"},
                      measurements=within + apart)
    fits = ProfileFits(profile)
    assert fits.link().bandwidth_gb_s == pytest.approx(50, rel=1e-3)
    assert fits.link().latency_us == pytest.approx(5, rel=1e-3)
    assert fits.link(between_devices=False).bandwidth_gb_s == pytest.approx(100, rel=1e-3)
    one_gpu = Profile(fingerprint=profile.fingerprint, measurements=within)
    assert ProfileFits(one_gpu).link().bandwidth_gb_s == pytest.approx(100, rel=1e-3)


def test_the_grid_measures_to_a_second_gpu_when_given_one():
    grid = Grid(**GRID)
    ids = [p.id for p in expand(grid, "gpu", ("gpu",), peer="cuda:1")]
    assert "target@gpu/kv_transfer/n64/to-cuda:1" in ids
    assert "target@gpu/kv_transfer/n256" in ids
    assert not [i for i in ids if i.startswith("draft@") and "to-" in i]  # the target's only
    assert not [p for p in expand(grid, "gpu", peer=None) if p.peer]
    off = Grid(**{**GRID, "kv_transfer": {"tokens": [64], "between_gpus": False}})
    assert not [p for p in expand(off, "gpu", peer="cuda:1") if p.peer]


def test_a_plan_without_a_second_gpu_says_it_skips_the_link(tmp_path):
    grid = Grid(**GRID)
    alone = make_plan(Request("qwen3-0.6b", grid, "g", "g.yaml", "cuda", peer=None))
    assert any("kv_transfer between GPUs is skipped" in note for note in alone.notes)
    assert not [p for p in alone.points if p.peer]
    two = make_plan(Request("qwen3-0.6b", grid, "g", "g.yaml", "cuda:0", peer="cuda:1"))
    assert not two.notes
    assert [p.id for p in two.points if p.peer] == [
        "target@gpu/kv_transfer/n64/to-cuda:1", "target@gpu/kv_transfer/n256/to-cuda:1"]
    assert set(two.estimate.points) == {p.id for p in two.points}
    assert not make_plan(Request("qwen3-0.6b", grid, "g", "g.yaml", "cpu")).notes
    assert peer_gpu("cpu") is None


def test_a_record_carries_its_pair_into_the_profile():
    point = Point("target", "gpu", "kv_transfer", 1, 64, peer="cuda:1")
    m = to_measurement(Record(point, 0.5, 3, 0.4, 0.6, bytes=64000, link="cuda:0->cuda:1"))
    assert m.link == "cuda:0->cuda:1" and m.between_devices


@pytest.mark.skipif(peer_gpu("cuda") is not None, reason="checks a machine without two GPUs")
def test_the_cli_notes_the_skipped_link_in_a_plan():
    from typer.testing import CliRunner

    from kestrel_cli.app import app

    result = CliRunner().invoke(app, ["calibrate", "--model", "qwen3-0.6b", "--device", "cuda",
                                      "--grid", "quick", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "note: kv_transfer between GPUs is skipped" in result.output
    assert "/to-cuda" not in result.output
