"""An output folder written all at once, so a failure leaves nothing half-written.

    with output_folder(out, overwrite=False) as folder:  # checked and staged here
        ...                                              # the work
        folder.commit(files)                             # renamed into place

Before any work: `out` must be a folder that can be made (no parent is a file, the place
is writable: a hidden staging folder `.NAME.*.partial` beside it is created to prove it),
and an existing `out` must be empty, hold only files named in `replaceable` (an earlier
output of the same command), or be replaced on purpose (`overwrite`; never a folder that
holds the working directory, the home folder or an input). `commit` writes the files
into the staging folder and renames it to `out` (an existing `out` is moved aside first
and deleted only once the new folder is in place). Leaving the block without a commit
(an error, Ctrl-C) removes the staging folder and any parent folders made for it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kestrel_sim.errors import OutputError


class OutputFolder:
    def __init__(self, out: Path, overwrite: bool = False,
                 replaceable: frozenset[str] = frozenset(), inputs: tuple[Path, ...] = ()):
        self.shown = out  # as the user wrote it, for messages
        self.out = Path(os.path.abspath(out))  # "." and ".." resolved, symlinks kept
        self.overwrite = overwrite
        self.replaceable = replaceable
        self.inputs = inputs  # files the command reads: never inside a replaced folder
        self.staging: Path | None = None
        self.made: list[Path] = []  # parent folders made for the staging folder, top first
        self.committed = False

    def check(self) -> None:
        """Refuse an `out` that cannot become this command's folder; writes nothing."""
        out, shown = self.out, self.shown
        if out.is_symlink():
            raise OutputError(f"--out {shown}: is a symbolic link; give the folder itself")
        if out.exists() and not out.is_dir():
            raise OutputError(f"--out {shown}: exists and is not a folder; give a folder path")
        if out.is_dir():
            self._check_existing()
        for parent in out.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise OutputError(f"--out {shown}: {parent} is a file, not a folder")
                break

    def _check_existing(self) -> None:
        entries = sorted(p.name for p in self.out.iterdir())
        foreign = [e for e in entries if e not in self.replaceable]
        if not foreign:
            return
        if not self.overwrite:
            listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            what = ("files this command did not write" if self.replaceable
                    else f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
            raise OutputError(
                f"--out {self.shown} already exists and holds {what} ({listed}): add "
                "--overwrite to replace the whole folder, or give a new --out")
        kept = [Path.cwd(), Path.home(), *(Path(os.path.abspath(p)) for p in self.inputs)]
        for path in kept:
            if path == self.out or self.out in path.parents:
                raise OutputError(f"--out {self.shown}: will not replace a folder that holds "
                                  f"{path}; give a new --out")

    def stage(self) -> None:
        """Make the staging folder (and missing parents): proves the place is writable."""
        parent = self.out.parent
        try:
            for folder in reversed([p for p in [parent, *parent.parents] if not p.exists()]):
                folder.mkdir()
                self.made.append(folder)
            staging = parent / f".{self.out.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
            staging.mkdir()  # as `out` would be made: permissions from the umask
            self.staging = staging
        except OSError as err:
            self.discard()
            raise OutputError(f"--out {self.shown}: cannot write in {parent} "
                              f"({err.strerror or err})") from None

    def commit(self, files: dict[str, str | bytes]) -> None:
        """Write `files` (name -> contents) and put the folder in place as `out`."""
        assert self.staging is not None and not self.committed, "commit() once, when staged"
        for name, content in files.items():
            path = self.staging / name  # "sub/name" makes the sub-folder
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        aside = None
        if self.out.exists():
            aside = self.out.with_name(f".{self.out.name}.{os.getpid()}.old")
            os.rename(self.out, aside)
        try:
            os.rename(self.staging, self.out)
        except BaseException:
            if aside is not None:
                os.rename(aside, self.out)
            raise
        self.committed = True
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def discard(self) -> None:
        """Unless committed: remove the staging folder and the parents made for it."""
        if self.committed:
            return
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
        for folder in reversed(self.made):
            try:
                folder.rmdir()
            except OSError:
                break
        self.made = []


@contextmanager
def output_folder(out: Path, overwrite: bool = False, replaceable: frozenset[str] = frozenset(),
                  inputs: tuple[Path, ...] = ()) -> Iterator[OutputFolder]:
    """Check and stage `out` now; the block's `commit` puts it in place; otherwise nothing
    is left behind."""
    folder = OutputFolder(out, overwrite, replaceable, inputs)
    folder.check()
    folder.stage()
    try:
        yield folder
    finally:
        folder.discard()
