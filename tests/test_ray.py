"""`kestrel sweep --ray` on a local Ray instance of 2 CPUs (issue 21): the same results as
the local process pool, a task whose worker dies is run again, finished points are never
lost, a resumed sweep recomputes nothing, and a cluster is reached by its address.
One Ray instance serves the whole module (starting one takes seconds); the sweep sees it
already initialized and uses it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kestrel_main import run_kestrel

from kestrel_cli import ray_pool, sweep  # after the skip: these tests need Ray
from kestrel_cli.ray_pool import RayPool
from kestrel_sim.errors import KestrelError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "scenarios" / "default.yaml"
GRID = ["--set", "workload.requests=20", "--set", "spec.k=1,2", "--set",
        "workload.arrivals.rate=4,8"]
REAL_POINT = sweep.simulate_point


@pytest.fixture(scope="module")
def ray_address():
    auth_mode = os.environ.get("RAY_AUTH_MODE")  # ray.init sets it for its child processes
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False, object_store_memory=100 * 2**20)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    if auth_mode is None:
        os.environ.pop("RAY_AUTH_MODE", None)


def kestrel(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr unwrapped) of `kestrel ARGS`."""
    code, _, err = run_kestrel(monkeypatch, capsys, *args)
    return code, " ".join(err.split())


def files(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> text); sweep.html aside (plotly ids)."""
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "sweep.html"}


def dies_once_at(point: tuple[int, float], marker: Path):
    """simulate_point, but the worker running `point` (spec.k, rate) dies the first time."""
    def run(scenario):
        if (scenario.spec.k, scenario.workload.arrivals.rate) == point and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)  # the worker process is gone, as if killed
        return REAL_POINT(scenario)
    return run


def always_dies_at(point: tuple[int, float]):
    def run(scenario):
        if (scenario.spec.k, scenario.workload.arrivals.rate) == point:
            os._exit(1)
        return REAL_POINT(scenario)
    return run


def noting_calls(folder: Path):
    """simulate_point, leaving one file per call in `folder` (the calls run in workers)."""
    def run(scenario):
        name = f"k{scenario.spec.k}-r{scenario.workload.arrivals.rate:g}-{os.getpid()}"
        (folder / name).write_text("")
        return REAL_POINT(scenario)
    return run


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory) -> Path:
    """The grid run by the local process pool: what Ray must reproduce."""
    out = tmp_path_factory.mktemp("local") / "sweep"
    result = subprocess.run([sys.executable, "-m", "kestrel_cli.app", "sweep", str(DEFAULT),
                             "-o", str(out), *GRID, "-j", "2"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    return out


def test_ray_gives_the_local_pools_results(ray_address, local_sweep, tmp_path, monkeypatch,
                                           capsys):
    out = tmp_path / "sweep"
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID, "--ray")
    assert code == 0, err
    assert "ran 4 of 4 scenarios with a local Ray instance (2 CPUs on 1 node)" in err
    assert files(out) == files(local_sweep)  # sweep.json, sweep.csv, each point: byte for byte
    assert len(files(out)) == 2 + 4  # sweep.json, sweep.csv and a file per point


def test_a_task_whose_worker_dies_is_run_again(ray_address, local_sweep, tmp_path,
                                               monkeypatch, capsys):
    marker = tmp_path / "died"
    monkeypatch.setattr(sweep, "simulate_point", dies_once_at((2, 8.0), marker))
    out = tmp_path / "sweep"
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID, "--ray")
    assert code == 0, err
    assert marker.exists()  # a worker did die, and its point was run again
    assert files(out) == files(local_sweep)


def test_finished_points_survive_a_point_that_kills_every_worker(ray_address, local_sweep,
                                                                  tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "simulate_point", always_dies_at((1, 4.0)))
    out = tmp_path / "sweep"
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID, "--ray")
    assert code == 1
    assert "1 of 4 grid points failed" in err and "WorkerCrashedError after 3 retries" in err
    assert "grid point spec.k=1 workload.arrivals.rate=4:" in err
    assert len(list((out / "points").iterdir())) == 3
    # a rerun runs the one point missing, and the whole matches the local pool's
    calls = tmp_path / "calls"
    calls.mkdir()
    monkeypatch.setattr(sweep, "simulate_point", noting_calls(calls))
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID, "--ray")
    assert code == 0, err
    assert [p.name.rsplit("-", 1)[0] for p in calls.iterdir()] == ["k1-r4"]
    assert files(out) == files(local_sweep)


def test_a_resumed_sweep_recomputes_nothing(ray_address, local_sweep, tmp_path, monkeypatch,
                                            capsys):
    out = tmp_path / "sweep"
    assert kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID, "--ray")[0] == 0
    calls = tmp_path / "calls"
    calls.mkdir()
    monkeypatch.setattr(sweep, "simulate_point", noting_calls(calls))
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", out, *GRID, "--ray")
    assert code == 0, err
    assert list(calls.iterdir()) == []
    assert "ran 0 of 4 scenarios and read 4 from" in err
    assert files(out) == files(local_sweep)


def test_a_pool_reports_each_outcome_and_keeps_an_instance_it_found(ray_address):
    with RayPool(max_retries=0) as pool:
        assert pool.label == "a local Ray instance (2 CPUs on 1 node)"
        outcomes = {o.key: o for o in pool.run(abs, {"0a": -3, "0b": 4, "0c": "x"})}
    assert outcomes["0a"].result == 3 and outcomes["0b"].result == 4
    assert not outcomes["0c"].ok and outcomes["0c"].error.startswith("TypeError: bad operand")
    assert "Traceback" in outcomes["0c"].details  # a fault carries its traceback
    assert ray.is_initialized()  # an instance this pool did not start is left running


def test_a_sweep_reaches_a_cluster_by_its_address(ray_address, local_sweep, tmp_path):
    out = tmp_path / "sweep"
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    result = subprocess.run([sys.executable, "-m", "kestrel_cli.app", "sweep", str(DEFAULT),
                             "-o", str(out), *GRID, "--ray", ray_address],
                            capture_output=True, text=True, timeout=300, env=env,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert f"with Ray at {ray_address} (2 CPUs on 1 node)" in " ".join(result.stderr.split())
    assert files(out) == files(local_sweep)


def test_jobs_with_a_cluster_address_is_refused_before_anything(tmp_path, monkeypatch, capsys):
    code, err = kestrel(monkeypatch, capsys, "sweep", DEFAULT, "-o", tmp_path / "s", *GRID,
                        "-j", "2", "--ray", "head:6379")
    assert code == 2 and "--jobs 2 with --ray head:6379: a cluster runs as many" in err
    assert list(tmp_path.iterdir()) == []


def test_a_cluster_lacking_a_file_or_running_other_code_is_refused(ray_address, monkeypatch):
    lacking = RayPool(ray_address, files=("/nowhere/profile.json",))
    with pytest.raises(KestrelError, match=r"a worker lacks 1 file\(s\) the tasks read "
                       r"\(/nowhere/profile.json\)"):
        lacking.__enter__()
    monkeypatch.setattr(ray_pool, "source_digest", lambda packages: "0123456789abcdef")
    with pytest.raises(KestrelError, match="the workers run other kestrel code than this "
                       "machine .kestrel_sim: source digest [0-9a-f]{16} there, 0123"):
        RayPool(ray_address).__enter__()
    assert ray.is_initialized()


# ---------------------------------------------------------------- kestrel calibrate --ray


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import tiny_models

    return {name: tiny_models.build(name, tmp_path_factory.mktemp(name))
            for name in ("tied", "untied")}


def calibrate_args(folders, out: Path) -> list:
    return ["calibrate", "--model", folders["tied"], "--draft", folders["untied"], "--device",
            "cpu", "--grid", "tiny", "--commit", "abc123", "--out", out, "--ray"]


def test_calibrate_on_ray_merges_its_parts_into_one_profile(ray_address, tiny_folders,
                                                            tmp_path, monkeypatch, capsys):
    from calibration.grid import expand, load_grid
    from kestrel_sim.profile import Profile

    out = tmp_path / "profile.json"
    code, err = kestrel(monkeypatch, capsys, *calibrate_args(tiny_folders, out))
    assert code == 0, err
    profile = Profile.load(out)
    grid, _ = load_grid("tiny")
    assert len(profile.measurements) == len(expand(grid, "cpu", ("cpu",)))
    assert {m.device for m in profile.measurements} == {"cpu"}
    assert set(profile.fingerprint.options) == {"target@cpu", "draft@cpu"}  # the plan's
    assert profile.fingerprint.git_commit == "abc123"
    assert f"wrote {out}" in err
    assert not (tmp_path / "profile.parts").exists()  # done: the parts are merged


def test_calibrate_on_ray_refuses_parts_of_different_setups(ray_address, tiny_folders,
                                                            tmp_path, monkeypatch, capsys):
    from kestrel_cli import calibrate_ray

    real = calibrate_ray.measure_part

    def other_torch_for_the_draft(part):
        result = real(part)
        if part.plan.benches[part.bench].name.startswith("draft"):
            result["profile"]["fingerprint"]["torch"] = "0.0-elsewhere"
        return result

    monkeypatch.setattr(calibrate_ray, "measure_part", other_torch_for_the_draft)
    out = tmp_path / "profile.json"
    code, err = kestrel(monkeypatch, capsys, *calibrate_args(tiny_folders, out))
    assert code == 2
    assert "any: the profiles were measured by different runs (torch:" in err
    assert "0.0-elsewhere" in err and "kept in" in err
    assert not out.exists()
    assert len(list((tmp_path / "profile.parts").glob("*.json"))) == 2  # nothing lost
