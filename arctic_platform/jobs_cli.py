"""``arctic-platform jobs``: list, inspect, cancel, tail and export a server's jobs.

Every command takes the server as ``--url`` (with ``--token-env`` naming the variable that holds
the bearer token) or as ``--config`` (a client config or recipe YAML whose ``backend`` is an
``http`` server or a ``cortex`` API), and prints a rich table, or with ``--json`` the server's
JSON answer. Exit status: 0 done, 1 the server refused (unknown job, bad token, ...), 2 bad
options.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    name="jobs",
    help="See and manage a server's jobs (as your token sees them).",
    no_args_is_help=True,
    add_completion=False,
)
FOLLOW_POLL_S = 1.0

Url = Annotated[str | None, typer.Option(help="Server URL, e.g. http://trainer-box:7000.")]
TokenEnv = Annotated[
    str | None, typer.Option(help="Environment variable holding your bearer token.")
]
ConfigYaml = Annotated[
    Path | None,
    typer.Option("--config", help="Client config or recipe YAML: its backend is the server."),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the server's JSON answer.")]
JobId = Annotated[str, typer.Argument(help="Job id (from `arctic-platform jobs list`).")]


def _client(url: str | None, token_env: str | None, config: Path | None):
    from arctic_platform._extras import require

    require("httpx", "client", purpose="arctic-platform jobs")
    from arctic_platform.client.jobs import jobs_client, server_from

    return jobs_client(server_from(url, token_env, config))


def _run(action, url: str | None, token_env: str | None, config: Path | None) -> Any:
    """Call ``action(client)``; server refusals exit 1 and bad options 2, with the message."""
    from rich.console import Console
    from rich.markup import escape

    from arctic_platform.client.errors import ArcticRLError

    try:
        with _client(url, token_env, config) as client:
            return action(client)
    except (ArcticRLError, OSError) as exc:  # a refusal, or a file it could not write
        Console(stderr=True, soft_wrap=True).print(
            f"[red]error:[/] {escape(str(exc))}", highlight=False
        )
        raise typer.Exit(code=1) from None
    except (ValueError, ImportError) as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"[red]error:[/] {escape(str(exc))}", highlight=False
        )
        raise typer.Exit(code=2) from None


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))


def age(seconds: float | None) -> str:
    """``42s``, ``7m``, ``3h``, ``2d`` (``-`` when unknown)."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _model(job: dict) -> str:
    return ", ".join(dict.fromkeys(s["model_name"] for s in job["sub_jobs"])) or "-"


def _last_op(job: dict, now: float) -> str:
    if job.get("last_op") is None:
        return "-"
    return f"{job['last_op']} ({age(now - job['last_op_at'])} ago)"


@app.command("list")
def list_jobs(
    url: Url = None,
    token_env: TokenEnv = None,
    config: ConfigYaml = None,
    status: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    as_json: AsJson = False,
) -> None:
    """Your jobs: id, state, model, age and the last op that ran."""
    answer = _run(lambda c: c.list(status), url, token_env, config)
    if as_json:
        _print_json(answer)
        return
    from rich.console import Console
    from rich.table import Table

    now = answer["now"]
    table = Table("ID", "STATE", "MODEL", "AGE", "LAST OP")
    for job in answer["jobs"]:
        table.add_row(
            job["job_id"],
            job["status"],
            _model(job),
            age(now - job["created_at"]),
            _last_op(job, now),
        )
    Console().print(table)


@app.command()
def show(
    job_id: JobId,
    url: Url = None,
    token_env: TokenEnv = None,
    config: ConfigYaml = None,
    as_json: AsJson = False,
) -> None:
    """One job: state, failure reason, sub-jobs, checkpoints and the config it was created with."""
    job = _run(lambda c: c.show(job_id), url, token_env, config)
    if as_json:
        _print_json(job)
        return
    from rich.console import Console
    from rich.json import JSON
    from rich.table import Table

    console = Console()
    now = job["now"]
    summary = Table.grid(padding=(0, 2))
    for key, value in (
        ("job", job["job_id"]),
        ("state", job["status"]),
        ("reason", job["reason"] or "-"),
        ("age", age(now - job["created_at"])),
        ("last op", _last_op(job, now)),
        ("experiment", job.get("experiment_name") or "-"),
    ):
        summary.add_row(f"[bold]{key}", str(value))
    console.print(summary)
    subs = Table("SUB-JOB", "TYPE", "STATE", "MODEL", title="sub-jobs")
    for sub in job["sub_jobs"]:
        subs.add_row(sub["sub_job_id"], sub["job_type"], sub["status"], sub["model_name"])
    console.print(subs)
    console.print(_checkpoint_table(job["checkpoints"], now))
    if job["config"] is not None:  # a Cortex-style API does not return it
        console.print("[bold]config")
        console.print(JSON.from_data(job["config"]))


def _checkpoint_table(checkpoints: list[dict], now: float):
    from rich.table import Table

    table = Table("CHECKPOINT", "STEPS", "AVG LOSS", "TYPE", "AGE", title="checkpoints")
    for c in checkpoints:
        loss = "-" if c.get("avg_loss") is None else f"{c['avg_loss']:.4f}"
        table.add_row(
            c["checkpoint_id"],
            str(c["global_steps"]),
            loss,
            c["checkpoint_type"],
            age(now - c["created_at"]),
        )
    return table


@app.command()
def cancel(
    job_id: JobId,
    url: Url = None,
    token_env: TokenEnv = None,
    config: ConfigYaml = None,
    as_json: AsJson = False,
) -> None:
    """Cancel a job: queued ops are dropped and its engines released."""
    job = _run(lambda c: c.cancel(job_id), url, token_env, config)
    if as_json:
        _print_json(job)
    else:
        typer.echo(f"{job['job_id']}: {job['status']}")


@app.command()
def logs(
    job_id: JobId,
    url: Url = None,
    token_env: TokenEnv = None,
    config: ConfigYaml = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """The job's log (what happened to it: engines built, state changes, op failures)."""

    def read(client) -> None:
        cursor = None
        while True:
            page = client.logs(job_id, cursor=cursor)
            for line in page["entries"]:
                typer.echo(json.dumps({"line": line}) if as_json else line)
            cursor = page["next_cursor"]
            if not follow or page["eof"]:
                return
            if not page["entries"]:
                time.sleep(FOLLOW_POLL_S)

    try:
        _run(read, url, token_env, config)
    except KeyboardInterrupt:
        raise typer.Exit(code=0) from None


@app.command()
def checkpoints(
    job_id: JobId,
    url: Url = None,
    token_env: TokenEnv = None,
    config: ConfigYaml = None,
    as_json: AsJson = False,
) -> None:
    """The job's checkpoints: id, global steps, average loss, type, age."""
    saved = _run(lambda c: c.checkpoints(job_id), url, token_env, config)
    if as_json:
        _print_json({"checkpoints": saved})
        return
    from rich.console import Console

    Console().print(_checkpoint_table(saved, time.time()))


@app.command()
def export(
    job_id: JobId,
    output: Annotated[Path, typer.Option(help="Directory the checkpoint's files go to.")],
    checkpoint: Annotated[
        str | None, typer.Option(help="Checkpoint id (default: the job's newest).")
    ] = None,
    url: Url = None,
    token_env: TokenEnv = None,
    config: ConfigYaml = None,
    as_json: AsJson = False,
) -> None:
    """Download a checkpoint's files (model weights, optimizer state, ...) into --output."""

    def download(client) -> list[dict]:
        files = []
        for entry in client.export(job_id, checkpoint, output):
            files.append(entry)
            if not as_json:
                typer.echo(f"{entry['path']}  {entry['size_bytes']} bytes")
        return files

    files = _run(download, url, token_env, config)
    if as_json:
        _print_json({"files": files})
