"""Running the `kestrel` console script in-process for the CLI tests."""

from __future__ import annotations

import sys

from kestrel_cli.app import main


def run_kestrel(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run `kestrel ARGS` as the console script does: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["kestrel", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err
