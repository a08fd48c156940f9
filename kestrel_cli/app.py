"""`kestrel`: one command, subcommands registered from their own modules.

User errors (KestrelError) print as one paragraph and exit 2, without a traceback.
Heavy imports (torch) happen inside the commands that need them.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from kestrel_cli import calibrate, generate, ray_option, simulate, suite, sweep
from kestrel_sim.errors import KestrelError

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def package_version() -> str:
    try:
        return version("kestrel")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def show_version(value: bool) -> None:
    if value:
        print(f"kestrel {package_version()}")
        raise typer.Exit()


@app.callback()
def options(
    version_: Annotated[bool, typer.Option(
        "--version", callback=show_version, is_eager=True,
        help="print the installed version and exit")] = False,
) -> None:
    """Kestrel: predict (simulator) and measure (runtime) LLM inference with speculative
    decoding and prefill/decode queues."""


app.command("run", short_help="Run a scenario on the simulator (--on hardware|both): "
            "metrics, trace, report.")(
    simulate.run)
app.command("sweep", cls=ray_option.RayAddressCommand,
            short_help="Run a scenario over a grid of --set values in parallel.")(sweep.sweep)
app.command("schema", short_help="Print the scenario JSON Schema.")(simulate.schema)
app.command("generate")(generate.generate)
app.command("validate", short_help="Run a folder of scenarios on both sides: error summary.")(
    suite.validate)
app.command("calibrate", cls=ray_option.RayAddressCommand,
            short_help="Time the runtime over a grid: a Profile.")(calibrate.calibrate)


def main() -> None:
    try:
        app()
    except KestrelError as err:
        # escape: a message's own brackets (pip install -e ".[cuda13]") are not rich markup
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(err))}",
                                                   highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
