"""Independent tasks run in a pool, each result saved as soon as it arrives.

A task is a key (a `task_store.content_key` of its input), an argument, and a module-level
function run as `fn(arg)` in a worker, returning something JSON-able. A pool (`LocalPool`,
`ray_pool.RayPool`) runs `call(fn, key, arg)` for each task and yields `Outcome`s in the order
they finish; `run_saving` writes each success to a `TaskStore` before passing it on, so
whatever happens next (Ctrl-C, a crash of the driver) finished work stays on disk.

    todo = {k: arg for k, arg in tasks.items() if k not in store.results(tasks)}
    with LocalPool(jobs) as pool:                  # or RayPool(address, task_gpus=1)
        for outcome in run_saving(pool, fn, todo, store, labels):
            ...                                    # progress, failures
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Protocol

from kestrel_cli.task_store import TaskStore
from kestrel_sim.errors import KestrelError


@dataclass
class Outcome:
    key: str
    result: Any = None
    error: str = ""           # "" when the task succeeded
    user_error: bool = False  # a KestrelError: bad input rather than a fault in kestrel
    details: str = ""         # a fault's traceback, for the report

    @property
    def ok(self) -> bool:
        return not self.error


def call(fn: Callable[[Any], Any], key: str, arg: Any) -> Outcome:
    """Run one task (in a worker) and catch what it raises: an error is an outcome too."""
    try:
        return Outcome(key, fn(arg))
    except KestrelError as err:
        return Outcome(key, error=str(err), user_error=True)
    except Exception as err:  # noqa: BLE001  (named and reported by the caller)
        return Outcome(key, error=f"{type(err).__name__}: {err}", details=traceback.format_exc())


class Pool(Protocol):
    label: str  # what runs the tasks, for messages ("2 processes", "Ray at host:6379 ...")

    def run(self, fn: Callable[[Any], Any], tasks: dict[str, Any]) -> Iterator[Outcome]: ...


def run_saving(pool: Pool, fn: Callable[[Any], Any], tasks: dict[str, Any], store: TaskStore,
               labels: dict[str, str], keep: Callable[[Any], bool] = lambda result: True,
               **run_options) -> Iterator[Outcome]:
    """Every task's outcome as it finishes, each success already saved in `store` (those
    `keep` accepts: a result worth computing again is not saved); `run_options` go to the
    pool's `run` (RayPool's per-task `options`)."""
    for outcome in pool.run(fn, tasks, **run_options):
        if outcome.ok and keep(outcome.result):
            store.save(outcome.key, outcome.result, labels.get(outcome.key, ""))
        yield outcome


class LocalPool:
    """Tasks in `jobs` processes on this machine (in this process when jobs is 1)."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self.label = f"{jobs} process{'es' if jobs > 1 else ''}"

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def run(self, fn: Callable[[Any], Any], tasks: dict[str, Any]) -> Iterator[Outcome]:
        if self.jobs == 1:
            for key, arg in tasks.items():
                yield call(fn, key, arg)
            return
        pool = ProcessPoolExecutor(max_workers=self.jobs)
        try:
            futures = {pool.submit(call, fn, key, arg): key for key, arg in tasks.items()}
            for future in as_completed(futures):
                try:
                    yield future.result()
                except Exception as err:  # noqa: BLE001  (the worker process died)
                    cause = err.__cause__  # a worker's traceback, as concurrent.futures passes it
                    details = (str(cause) if cause is not None
                               else "".join(traceback.format_exception(err)))
                    yield Outcome(futures[future], error=f"{type(err).__name__}: {err}",
                                  details=details)
        finally:  # on Ctrl-C or an early exit: run nothing more than what has started
            pool.shutdown(wait=True, cancel_futures=True)
