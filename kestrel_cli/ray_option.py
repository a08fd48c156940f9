"""The `--ray [ADDRESS]` option: a flag whose value may be left out.

Typer options always take their value, so a command that offers `--ray` registers with
`cls=RayAddressCommand`, which reads `--ray` alone as `--ray local` (a new local Ray
instance) before the usual parsing. The word after `--ray` is its address only when it looks
like one (`ray://HOST:PORT`, `HOST:PORT`, `auto`, `local`): `--ray scenario.yaml` stays a
flag followed by the scenario.
"""

from __future__ import annotations

import re

from typer.core import TyperCommand

from kestrel_cli.ray_pool import LOCAL

OPTION = "--ray"
ADDRESS = re.compile(r"(ray://)?[^\s/:]+:\d+|auto|local")
HELP = ("run the grid as Ray tasks: on a new local Ray instance (--ray), or on a running "
        "cluster (--ray ray://HEAD:10001 or --ray HEAD:6379); needs pip install "
        "'kestrel\\[ray]'. Points already in --out are not run again")


def with_ray_address(args: list[str]) -> list[str]:
    """`args` with `--ray` given its value `local` where it has none."""
    done: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return done + args[i:]
        done.append(arg)
        if arg == OPTION and (i + 1 == len(args) or not ADDRESS.fullmatch(args[i + 1])):
            done.append(LOCAL)
    return done


class RayAddressCommand(TyperCommand):
    def parse_args(self, ctx, args):
        return super().parse_args(ctx, with_ray_address(list(args)))
