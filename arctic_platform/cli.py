"""The ``arctic-platform`` command line.

Subcommands are added by the layers that own them; each imports its heavy dependencies only when it
runs, so ``arctic-platform --help`` works with no extra installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind (non-loopback needs a token).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="TCP port.")] = 7000,
    token_env: Annotated[
        str | None,
        typer.Option(help="Environment variable holding the bearer token(s), comma-separated."),
    ] = None,
    data_dir: Annotated[Path, typer.Option(help="Where checkpoints and job metadata live.")] = Path(
        "arctic-data"
    ),
    device: Annotated[str, typer.Option(help="Engine device: auto, cpu, cuda, cuda:N.")] = "auto",
    max_body_mb: Annotated[int, typer.Option(min=1, help="Largest request body (MiB).")] = 256,
    max_concurrent_ops: Annotated[
        int, typer.Option(min=1, help="Ops running at once across jobs.")
    ] = 2,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
) -> None:
    """Serve the on-prem and Cortex-compatible HTTP APIs over one set of engines."""
    from arctic_platform._extras import require

    require("fastapi", "server", purpose="arctic-platform serve")
    require("torch", "server", purpose="arctic-platform serve")
    from arctic_platform.server.serve import serve as run_server

    run_server(
        host=host,
        port=port,
        token_env=token_env,
        data_dir=data_dir,
        device=device,
        max_body_mb=max_body_mb,
        max_concurrent_ops=max_concurrent_ops,
        log_level=log_level,
    )


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
