"""Tasks as Ray tasks, on a fresh local Ray instance or on a running cluster.

    with RayPool("local", cpus=2) as pool:              # or RayPool("ray://head:10001")
        for outcome in pool.run(fn, {key: arg, ...}):   # tasks.Outcome, as each finishes
            ...

A pool used for GPU work asks one GPU per task (`task_gpus=1`); `run`'s `options` adds Ray
options per task (say `{"accelerator_type": "H100"}`) to place a task on a kind of device.
A task whose worker process dies (killed, out of memory, a crashed node) is run again, up to
`max_retries` times; an exception raised by the task itself is its outcome, not retried.
Where Ray is already initialized in this process (a notebook, a test), that instance is used
and left running. On a cluster, a first probe task checks that the workers run the same
kestrel code as here (`source_digest`), so results equal those of the local pool, and hold
the files the tasks read (`files`: a scenario's profile, traces, CSVs) at the same paths.
Ray is optional: `pip install kestrel[ray]`; `require_ray` says so when it is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kestrel_cli.task_store import source_digest
from kestrel_cli.tasks import Outcome, call
from kestrel_sim.errors import KestrelError

INSTALL = 'pip install "kestrel[ray]" (from a clone: pip install -e ".[ray]")'
LOCAL = "local"  # Ray's own address for "start a new instance on this machine"
LOCAL_OBJECT_STORE = 256 * 2**20  # bytes; tasks pass scenarios and metrics, a few kB each
PROBE_TIMEOUT_S = 300  # a cluster may have to start a worker, or a node, for the probe


def require_ray(command: str):
    """The ray module, or a KestrelError saying what to install."""
    try:
        import ray
    except ImportError:
        raise KestrelError(f"{command} --ray needs Ray, which is not installed here: "
                           f"{INSTALL}; without --ray it runs on this machine") from None
    return ray


def worker_probe(packages: tuple[str, ...], files: tuple[str, ...]) -> tuple[str, list[str]]:
    """Run on a worker: its source digest of `packages`, and which of `files` it lacks."""
    return source_digest(packages), [f for f in files if not Path(f).is_file()]


class RayPool:
    def __init__(self, address: str = LOCAL, cpus: int | None = None, task_cpus: float = 1,
                 task_gpus: float = 0, max_retries: int = 3,
                 same_code: tuple[str, ...] = ("kestrel_sim",), files: tuple[str, ...] = (),
                 command: str = "kestrel"):
        self.address = address
        self.cpus = cpus  # of a local instance; a cluster has its own
        self.task_cpus, self.task_gpus = task_cpus, task_gpus
        self.max_retries = max_retries
        self.same_code = same_code  # packages the workers must hold unchanged
        self.files = files  # absolute paths the tasks read, which every node must have
        self.ray = require_ray(command)
        self.started = False
        self.label = "Ray"

    def __enter__(self):
        ray = self.ray
        if not ray.is_initialized():
            self.connect()
            self.started = True
        try:
            resources = ray.cluster_resources()
            nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
            where = "a local Ray instance" if self.address == LOCAL else f"Ray at {self.address}"
            gpus = f", {resources['GPU']:g} GPUs" if resources.get("GPU") else ""
            self.label = (f"{where} ({resources.get('CPU', 0):g} CPUs{gpus} on {nodes} "
                          f"node{'s' if nodes != 1 else ''})")
            if self.task_gpus and resources.get("GPU", 0) < self.task_gpus:
                raise KestrelError(f"{self.label} has no GPU, and each task needs "
                                   f"{self.task_gpus:g}; give the address of a cluster with GPUs")
            if self.address != LOCAL:
                self.check_workers()
        except BaseException:
            self.__exit__()
            raise
        return self

    def connect(self) -> None:
        ray = self.ray
        local = self.address == LOCAL
        settings = {"logging_level": logging.WARNING, "log_to_driver": False}
        if local:  # what a new instance is made with; a cluster has its own
            settings.update(num_cpus=self.cpus, object_store_memory=LOCAL_OBJECT_STORE,
                            include_dashboard=False)
        try:
            ray.init(address=self.address, **settings)
        except (ConnectionError, ValueError, RuntimeError) as err:
            where = "start a local Ray instance" if local else f"connect to Ray at {self.address}"
            raise KestrelError(
                f"--ray: cannot {where} ({err}); a cluster's address is ray://HEAD:10001 "
                "(Ray Client) or HEAD:6379 (its GCS), as `ray start --head` prints, and a "
                "cluster with token authentication also needs RAY_AUTH_MODE=token and its "
                "token") from None

    def check_workers(self) -> None:
        """Refuse a cluster whose workers cannot import kestrel, run other code, or lack a
        file the tasks read."""
        ray = self.ray
        probe = ray.remote(worker_probe).options(num_cpus=0, max_retries=self.max_retries)
        here = source_digest(self.same_code)
        try:
            there, missing = ray.get(probe.remote(self.same_code, self.files),
                                     timeout=PROBE_TIMEOUT_S)
        except ray.exceptions.RayError as err:
            raise KestrelError(f"{self.label}: a worker could not run kestrel "
                               f"({type(err).__name__}: {str(err).strip().splitlines()[-1]}); "
                               "install kestrel, this same version, on every node") from None
        if there != here:
            raise KestrelError(
                f"{self.label}: the workers run other kestrel code than this machine "
                f"({', '.join(self.same_code)}: source digest {there} there, {here} here), so "
                "their results could differ; install this same version on every node")
        if missing:
            raise KestrelError(
                f"{self.label}: a worker lacks {len(missing)} file(s) the tasks read "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); give every "
                "node the same files at the same paths (a shared filesystem, or the same "
                "checkout path)")

    def __exit__(self, *exc) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False

    def run(self, fn: Callable[[Any], Any], tasks: dict[str, Any],
            options: dict[str, dict] | None = None) -> Iterator[Outcome]:
        """Submit every task at once; yield each outcome as its task finishes."""
        ray = self.ray
        remote = ray.remote(call)
        pending = {}
        for key, arg in tasks.items():
            task = remote.options(num_cpus=self.task_cpus, num_gpus=self.task_gpus,
                                  max_retries=self.max_retries, retry_exceptions=False,
                                  **(options or {}).get(key, {}))
            pending[task.remote(fn, key, arg)] = key
        try:
            while pending:
                ready, rest = ray.wait(list(pending), num_returns=1)
                if rest:  # everything else already finished comes in the same round
                    ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
                for ref in ready:
                    key = pending.pop(ref)
                    try:
                        yield ray.get(ref)
                    except ray.exceptions.RayError as err:  # its worker died, retries spent
                        yield Outcome(key, error=f"{type(err).__name__} after {self.max_retries}"
                                      f" retries: {str(err).strip().splitlines()[0]}",
                                      details=str(err))
        finally:  # Ctrl-C or an early exit: a cluster should not go on with the rest
            for ref in pending:
                ray.cancel(ref)
