"""The ``arctic-platform`` command line.

Subcommands are added by the layers that own them; each imports its heavy dependencies only when it
runs, so ``arctic-platform --help`` works with no extra installed.
"""

from __future__ import annotations

import typer

import arctic_platform

app = typer.Typer(
    name="arctic-platform",
    help="RL post-training compute: one client, four backends (inprocess, http, ray, cortex).",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """RL post-training compute: one client, four backends (inprocess, http, ray, cortex)."""


@app.command()
def version() -> None:
    """Print the installed version."""
    typer.echo(arctic_platform.__version__)


def main() -> None:
    """Console-script entry point."""
    app()
