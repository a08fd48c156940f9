"""Shared test set-up: tests under tests/gpu are marked `gpu` and skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parent / "gpu"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """With xdist workers on a CUDA machine with cupy: compile every kernel module once, in
    parallel, before the workers start (kestrel_rt/cuda/precompile.py, with the every-variant
    gemv modules of the variant tests), so each worker loads them from cupy's disk cache
    instead of all compiling the same modules at once."""
    config = session.config
    if hasattr(config, "workerinput") or not (config.getoption("numprocesses", None) or 0):
        return
    try:
        import cupy  # noqa: F401
    except ImportError:
        return
    if not _cuda_available():
        return
    from kestrel_rt.cuda.precompile import precompile

    results = precompile(sweep=True)  # the variant tests' every-variant modules too
    failed = [f"{'/'.join(map(str, job))}: {err}" for job, _, err in results if err]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"precompiled {len(results) - len(failed)} of {len(results)} kernel "
                            "modules" + "".join(f"\n  failed {f}" for f in failed))


@pytest.fixture(scope="session", autouse=True)
def one_cpu_thread_for_torch():
    """On a machine without CUDA, torch runs the tests' tiny models on one intra-op thread:
    its thread pool costs tiny ops far more than it saves, and on a shared 2-core machine
    it made spec tests 10-100x slower. GPU machines keep torch's default."""
    try:
        import torch
    except ImportError:
        yield
        return
    if torch.cuda.is_available():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 checkpoint with tied embeddings (tests/tiny_models.py), one per module:
    the serving, placement and run-on-hardware tests' model. A module that needs another
    kind of folder defines its own `folder`."""
    from tiny_models import build

    return build("tied", tmp_path_factory.mktemp("tied") / "tied")
