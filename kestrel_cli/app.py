"""`kestrel`: one command, subcommands registered from their own modules.

User errors (KestrelError) print as one paragraph and exit 2, without a traceback.
Heavy imports (torch) happen inside the commands that need them.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from kestrel_cli import generate, simulate, sweep
from kestrel_sim.errors import KestrelError

app = typer.Typer(
    help="Kestrel: predict (simulator) and measure (runtime) LLM inference with "
    "speculative decoding and prefill/decode queues.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("run")(simulate.run)
app.command("sweep")(sweep.sweep)
app.command("schema")(simulate.schema)
app.command("generate")(generate.generate)


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
