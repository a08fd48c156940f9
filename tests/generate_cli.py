"""Running `kestrel generate` in-process for the CLI tests, and reading its errors."""

from __future__ import annotations

from typer.testing import CliRunner

from kestrel_cli.app import app
from kestrel_sim.errors import KestrelError

runner = CliRunner()


def invoke(*args: str):
    """`kestrel generate ARGS` through typer's CliRunner; the Result."""
    return runner.invoke(app, ["generate", *args])


def error_of(result) -> str:
    """The KestrelError a CliRunner run stopped with (app.main prints it and exits 2)."""
    assert result.exit_code != 0
    assert isinstance(result.exception, KestrelError), repr(result.exception)
    message = str(result.exception)
    assert "\n" not in message
    return message
