"""The output folder of a command that streams results in as they finish and resumes on a
rerun (`kestrel sweep`):

    with results_folder(out, keys, overwrite, SWEEP_FILES, inputs) as folder:
        folder.store                 # a TaskStore in out/points: one file per finished task
        ...                          # run the tasks folder.store lacks, saving each result
        folder.finish(files)         # the summary files, each written whole, last

Which folder the results go to, decided before any work:
- `out` is new or empty: straight into it, so an interrupted run keeps what it finished.
  Folders made for it are removed again if nothing was saved (every task failed, or Ctrl-C
  came first): a run that produced nothing leaves nothing.
- `out` holds this command's files and results of tasks in `keys` only (an earlier run of
  the same tasks, finished or not, or of a subset): resumed in place.
- anything else is refused, as `outdir.OutputFolder` refuses it, unless `overwrite`; then
  (and whenever `overwrite` meets a non-empty `out`) the run starts afresh in a staging
  folder that replaces `out` at `finish`, and an unfinished run leaves `out` as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kestrel_cli.outdir import OutputFolder
from kestrel_cli.task_store import TaskStore
from kestrel_sim.errors import OutputError

POINTS = "points"


class ResultsFolder:
    def __init__(self, folder: Path, staged: OutputFolder | None):
        self.folder = folder  # where results and summary files are written now
        self.staged = staged  # set when `folder` is a staging folder that replaces `out`
        self.store = TaskStore(folder / POINTS)

    def finish(self, files: dict[str, str]) -> None:
        """Write the summary files (name -> text), each whole, and put a staged folder in place."""
        if self.staged is not None:
            self.staged.commit(files)
            return
        for name, text in files.items():
            temporary = self.folder / f".{name}.{os.getpid()}.tmp"
            temporary.write_text(text)
            os.replace(temporary, self.folder / name)


def make_folders(folder: Path, shown: Path) -> list[Path]:
    """Make `folder` and its missing parents; those made, top first."""
    made: list[Path] = []
    for path in reversed([folder, *folder.parents]):
        if path.exists():
            continue
        try:
            path.mkdir()
        except OSError as err:
            remove_folders(made)
            raise OutputError(f"--out {shown}: cannot write in {path.parent} "
                              f"({err.strerror or err})") from None
        made.append(path)
    if not os.access(folder, os.W_OK | os.X_OK):
        remove_folders(made)
        raise OutputError(f"--out {shown}: cannot write in {folder}")
    return made


def remove_folders(made: list[Path]) -> None:
    """Remove folders made (top first), deepest first, as far as they are empty."""
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:
            break


@contextmanager
def results_folder(out: Path, keys: set[str], overwrite: bool, files: frozenset[str],
                   inputs: tuple[Path, ...] = ()) -> Iterator[ResultsFolder]:
    """Check `out` and open the folder results go to (see the module's docstring)."""
    checker = OutputFolder(out, overwrite, files | {POINTS}, inputs)
    checker.check()  # a link, a file, a file for a parent, foreign files without --overwrite
    path = checker.out
    if overwrite and path.is_dir() and any(path.iterdir()):
        checker.stage()
        (checker.staging / POINTS).mkdir()
        try:
            yield ResultsFolder(checker.staging, checker)
        finally:
            checker.discard()
        return
    other = TaskStore(path / POINTS).keys() - keys
    if other:
        raise OutputError(
            f"--out {out} already exists and holds results of other tasks ({len(other)} in "
            f"{POINTS}/ are not in this run: another grid, scenario or kestrel version): add "
            "--overwrite to replace the whole folder, or give a new --out")
    made = make_folders(path / POINTS, out)
    folder = ResultsFolder(path, None)
    try:
        yield folder
    finally:
        if not folder.store.keys():
            remove_folders(made)
