"""The ``arctic-platform`` command line.

Subcommands are added by the layers that own them; each imports its heavy dependencies only when it
runs, so ``arctic-platform --help`` works with no extra installed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

import arctic_platform
from arctic_platform.jobs_cli import app as jobs_app
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.ray_placement import PLACEMENT_TIMEOUT_S
from arctic_platform.server.tenant_quota import DEFAULT_MAX_JOBS_PER_TENANT, TenantQuota
from arctic_platform.server.tinker.session_reaper import SESSION_TIMEOUT_S

app = typer.Typer(
    name="arctic-platform",
    help="RL post-training compute: one client, four backends (inprocess, http, ray, cortex).",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(jobs_app, name="jobs")

# The levels ``serve --log-level`` takes: Python's logging and uvicorn's, by the same names.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@app.callback()
def _root() -> None:
    """RL post-training compute: one client, four backends (inprocess, http, ray, cortex)."""


@app.command()
def version() -> None:
    """Print the installed version."""
    typer.echo(arctic_platform.__version__)


@app.command("export-model")
def export_model(
    name: Annotated[str, typer.Argument(help="A built-in model: builtin:tiny or builtin:small.")],
    destination: Annotated[Path, typer.Argument(help="A new folder to write the HF model into.")],
) -> None:
    """Write a built-in model as an ordinary Hugging Face folder (config, weights, tokenizer),
    for frameworks that need a model path (verl's actor_rollout_ref.model.path)."""
    from arctic_platform.engine.builtin import export_builtin_model

    try:
        path = export_builtin_model(name, destination)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except OSError as exc:  # the destination is a file, or cannot be written
        raise typer.BadParameter(f"destination: {destination}: {exc.strerror}") from None
    typer.echo(str(path))


@app.command()
def train(
    config: Annotated[
        Path | None, typer.Option(help="Recipe YAML (default: the built-in addition recipe).")
    ] = None,
    backend: Annotated[
        str | None, typer.Option(help="inprocess, http, cortex or ray (default: the recipe's).")
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(help="Server URL for --backend http|cortex; without it one is started."),
    ] = None,
    output_dir: Annotated[
        Path | None, typer.Option(help="Run directory (default: runs/<timestamp>).")
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue the run in --output-dir (or the newest one).")
    ] = False,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a recipe key, e.g. --set grpo.steps=20 (repeatable)."),
    ] = None,
    logger: Annotated[
        list[str] | None,
        typer.Option(
            help="Also send metrics to tensorboard, wandb or mlflow (repeatable; adds to the "
            "recipe's logging.backends)."
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
) -> None:
    """Run a recipe: SFT warm-up then GRPO; writes metrics.jsonl, the reward plot and the
    configured trackers."""
    from arctic_platform._extras import require

    require("torch", "recipes", purpose="arctic-platform train")
    require("matplotlib", "recipes", purpose="the reward plot")
    from rich.console import Console
    from rich.markup import escape

    from arctic_platform.client.errors import ArcticRLError
    from arctic_platform.recipes.config import load_recipe
    from arctic_platform.recipes.grpo import run_recipe
    from arctic_platform.recipes.launch import (
        backend_settings,
        check_options,
        resolve_run_dir,
        server_for_run,
    )
    from arctic_platform.recipes.trackers import check_installed

    console = Console()
    try:
        check_options(backend, url)
        # The recipe checked before a server is started for it (its backend comes after).
        load_recipe(config, set_ or [], loggers=logger)
        run_dir = resolve_run_dir(output_dir, resume=resume)
        with server_for_run(backend, url, run_dir) as server_url:
            recipe = load_recipe(
                config, set_ or [], backend_settings(backend, server_url), loggers=logger
            )
            check_installed(recipe.logging.backends)
            console.print(f"[bold]{recipe.name}[/] -> {run_dir}")
            summary = run_recipe(recipe, run_dir, resume=resume, show_progress=progress)
    except (ValueError, ImportError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    except (ArcticRLError, OSError) as exc:  # the server refused, a file could not be written
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=1) from None
    grpo_evals = summary.eval_rewards("grpo")
    sft_evals = summary.eval_rewards("sft")
    if grpo_evals:
        start = sft_evals[-1] if sft_evals else None
        begin = "n/a" if start is None else f"{start:.3f}"
        console.print(
            f"held-out reward: {begin} when GRPO started -> {grpo_evals[-1]:.3f} at the end"
        )
    console.print(f"metrics: {summary.metrics_path}")
    console.print(f"plot:    {summary.plot_path}")


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind (non-loopback needs a token).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 7000,
    token_env: Annotated[
        str | None,
        typer.Option(help="Environment variable holding the bearer token(s), comma-separated."),
    ] = None,
    metrics_token_env: Annotated[
        str | None,
        typer.Option(
            help="Environment variable holding the operator's scrape token(s): GET /metrics "
            "with it shows every tenant's jobs (a tenant's token shows only its own).",
        ),
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
    ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Run the engines as Ray actors; a training job runs data-parallel over its "
            "n_gpus workers.",
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(help="With --ray: auto (default), local, or a cluster's host:port."),
    ] = None,
    colocate: Annotated[
        bool, typer.Option(help="With --ray: put a job's trainer and samplers on shared devices.")
    ] = False,
    placement_timeout: Annotated[
        float,
        typer.Option(
            help="With --ray: seconds a job whose resources other jobs hold waits for them "
            "before it fails (the job's log says what it waits for).",
        ),
    ] = PLACEMENT_TIMEOUT_S,
    ray_autoscaling: Annotated[
        bool,
        typer.Option(
            help="With --ray: the cluster adds nodes on demand, so a job larger than it is now "
            "waits (up to --placement-timeout) instead of failing at once.",
        ),
    ] = False,
    instance_id: Annotated[
        str | None, typer.Option(help="The id /health reports (launchers set it).", hidden=True)
    ] = None,
    parent_pid: Annotated[
        int | None, typer.Option(help="Stop when this process (the launcher) dies.", hidden=True)
    ] = None,
    sampling_engine: Annotated[
        str,
        typer.Option(
            help="Engine of sampling jobs that do not choose one: torch (ours) or vllm "
            "(vLLM in its own process; see --vllm-python)."
        ),
    ] = "torch",
    vllm_python: Annotated[
        Path | None,
        typer.Option(
            help="Python of the environment that has vLLM (default: $ARCTIC_VLLM_PYTHON, else "
            "this interpreter if it imports vllm)."
        ),
    ] = None,
    allow_path: Annotated[
        list[Path] | None,
        typer.Option(
            help="A folder clients may read models and checkpoints from (repeatable); otherwise "
            "every client path stays in its tenant's folder under --data-dir.",
        ),
    ] = None,
    allow_write_path: Annotated[
        list[Path] | None,
        typer.Option(
            help="A folder clients may also save checkpoints into, and load them back from "
            "(repeatable; every tenant shares it). A server launched by its user's own driver "
            "passes /.",
        ),
    ] = None,
    max_ops_per_tenant: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Op slots one tenant may hold at once (default: all but one when there are "
            "several tokens, so another tenant always finds a slot).",
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="On SIGTERM, seconds ops in flight may take before their jobs are failed.",
        ),
    ] = 30.0,
    max_samples_per_request: Annotated[
        int, typer.Option(min=1, help="Samples (n summed over prompts) in one generate.")
    ] = ServerLimits.max_samples_per_request,
    max_sample_tokens: Annotated[
        int, typer.Option(min=1, help="n x max_tokens summed over one generate's prompts.")
    ] = ServerLimits.max_sample_tokens,
    max_batch_rows: Annotated[
        int, typer.Option(min=1, help="Rows in one training/forward batch or log-probs call.")
    ] = ServerLimits.max_batch_rows,
    max_batch_tokens: Annotated[
        int, typer.Option(min=1, help="Rows x sequence length of one training/forward batch.")
    ] = ServerLimits.max_batch_tokens,
    body_read_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a request body may take to arrive; a slower upload is answered 408 "
            "and its connection closed.",
        ),
    ] = ServerLimits.body_read_timeout,
    header_read_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a request's head (request line and headers) may take to arrive from "
            "the connection's opening or the request's first byte; a slower connection is "
            "closed.",
        ),
    ] = ServerLimits.header_read_timeout,
    max_uploads_per_tenant: Annotated[
        int,
        typer.Option(
            min=1,
            help="Request bodies one tenant may have partly sent at once; one more gets 429.",
        ),
    ] = ServerLimits.max_uploads_per_tenant,
    max_chunk_group_mb: Annotated[
        int,
        typer.Option(
            min=1,
            help="MiB one tenant's incomplete Cortex chunk groups may hold (also the largest "
            "frame it can send in chunks); a chunk beyond it gets 429, a frame beyond it 413.",
        ),
    ] = ServerLimits.max_chunk_group_mb,
    max_long_polls_per_tenant: Annotated[
        int,
        typer.Option(
            min=1,
            help="Long polls (get-job with wait_s, Tinker retrieve_future) one tenant may have "
            "waiting at once, each holding a connection; one more gets 429.",
        ),
    ] = ServerLimits.max_long_polls_per_tenant,
    max_openai_requests_per_tenant: Annotated[
        int,
        typer.Option(
            min=1,
            help="OpenAI-API requests one tenant may have under way at once, each holding a "
            "connection until its answer; one more gets 429.",
        ),
    ] = ServerLimits.max_openai_requests_per_tenant,
    max_tinker_sessions_per_tenant: Annotated[
        int,
        typer.Option(
            min=1,
            help="Tinker sessions one tenant may have open at once (created, not finished nor "
            "timed out); one more gets 429.",
        ),
    ] = ServerLimits.max_tinker_sessions_per_tenant,
    max_pending_mb_per_tenant: Annotated[
        int,
        typer.Option(
            min=1,
            help="MiB of ops one tenant may have accepted and not finished (queued, waiting "
            "for their turn, or running), each holding its body; one more gets 429.",
        ),
    ] = ServerLimits.max_pending_mb_per_tenant,
    max_retained_results_mb: Annotated[
        int,
        typer.Option(
            min=1,
            help="MiB of finished ops' results the Cortex and Tinker APIs each keep for clients "
            "to fetch; past it the tenant (Cortex: the job) holding the most drops its oldest.",
        ),
    ] = ServerLimits.max_retained_results_mb,
    max_json_mb: Annotated[
        int,
        typer.Option(
            min=1,
            help="MiB of JSON in one request body or DSSST1 frame header (parsed JSON costs "
            "several times its size in memory); more gets 413.",
        ),
    ] = ServerLimits.max_json_mb,
    tinker_session_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a Tinker SDK session may go without a heartbeat (the SDK sends one "
            "every 10 s) before the server finishes it and frees its engines.",
        ),
    ] = SESSION_TIMEOUT_S,
    job_idle_timeout: Annotated[
        float | None,
        typer.Option(
            help="Cancel a job (releasing its engines) when no op was submitted or running for "
            "this many seconds, e.g. one whose driver crashed without closing its client. "
            "Status, list and log reads do not count as use. Default: jobs live until cancelled.",
        ),
    ] = None,
    max_jobs_per_tenant: Annotated[
        int,
        typer.Option(
            min=1,
            help="Jobs one tenant may hold at once (created and not yet ended; a Tinker training "
            "client or model sampler is one each); more are refused with 409 limit_exceeded.",
        ),
    ] = DEFAULT_MAX_JOBS_PER_TENANT,
    max_model_bytes_per_tenant: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Bytes of model weights (the model folders' weight files) one tenant's live jobs "
            "may load in all; more are refused with 409 limit_exceeded. Default: no bound.",
        ),
    ] = None,
    max_checkpoint_bytes_per_tenant: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Bytes of checkpoints one tenant may keep on this server (every API's saves, "
            "on any of its jobs, ended ones included, until deleted); a save that would pass it "
            "is refused with 409 limit_exceeded before anything is written. Default: no bound.",
        ),
    ] = None,
) -> None:
    """Serve the on-prem and Cortex-compatible HTTP APIs over one set of engines."""
    from arctic_platform._extras import require, require_installed

    if not ray and (ray_address is not None or colocate or ray_autoscaling):
        raise typer.BadParameter("--ray-address, --colocate and --ray-autoscaling need --ray")
    if not placement_timeout > 0:
        raise typer.BadParameter(
            f"--placement-timeout: must be > 0 seconds, got {placement_timeout}"
        )
    if sampling_engine not in ("torch", "vllm"):
        raise typer.BadParameter(
            f"--sampling-engine: expected torch or vllm, got {sampling_engine!r}"
        )
    if log_level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(
            f"--log-level: expected one of {', '.join(LOG_LEVELS)}, got {log_level!r}"
        )
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise typer.BadParameter(f"--device: expected auto, cpu, cuda or cuda:N, got {device!r}")
    if data_dir.exists() and not data_dir.is_dir():
        raise typer.BadParameter(f"--data-dir: {data_dir} is a file, not a folder")
    if ray and (sampling_engine != "torch" or vllm_python is not None):
        raise typer.BadParameter("--sampling-engine vllm and --vllm-python run without --ray")
    if vllm_python is not None and not vllm_python.is_file():
        raise typer.BadParameter(f"--vllm-python: {vllm_python} is not a file")
    if not tinker_session_timeout > 0:
        raise typer.BadParameter(
            f"--tinker-session-timeout: must be > 0 seconds, got {tinker_session_timeout}"
        )
    if not body_read_timeout > 0:
        raise typer.BadParameter(
            f"--body-read-timeout: must be > 0 seconds, got {body_read_timeout}"
        )
    if not header_read_timeout > 0:
        raise typer.BadParameter(
            f"--header-read-timeout: must be > 0 seconds, got {header_read_timeout}"
        )
    if job_idle_timeout is not None and not job_idle_timeout > 0:
        raise typer.BadParameter(f"--job-idle-timeout: must be > 0 seconds, got {job_idle_timeout}")
    # After the flags, so a bad one is answered at once; torch is imported by the first engine.
    require("fastapi", "server", purpose="arctic-platform serve")
    require_installed("torch", "server", purpose="arctic-platform serve")
    if ray:
        require("ray", "ray", purpose="arctic-platform serve --ray")
    from arctic_platform.server.serve import serve as run_server

    run_server(
        host=host,
        port=port,
        token_env=token_env,
        metrics_token_env=metrics_token_env,
        data_dir=data_dir,
        device=device,
        max_body_mb=max_body_mb,
        max_concurrent_ops=max_concurrent_ops,
        log_level=log_level,
        ray_address=(ray_address or "auto") if ray else None,
        colocate=colocate,
        placement_timeout_s=placement_timeout,
        ray_autoscaling=ray_autoscaling,
        instance=instance_id,
        parent_pid=parent_pid,
        sampling_engine=sampling_engine,
        vllm_python=None if vllm_python is None else str(vllm_python),
        allowed_paths=tuple(allow_path or ()),
        writable_paths=tuple(allow_write_path or ()),
        max_ops_per_tenant=max_ops_per_tenant,
        drain_timeout=drain_timeout,
        tinker_session_timeout_s=tinker_session_timeout,
        job_idle_timeout_s=job_idle_timeout,
        quota=TenantQuota(
            max_jobs_per_tenant=max_jobs_per_tenant,
            max_model_bytes_per_tenant=max_model_bytes_per_tenant,
            max_checkpoint_bytes_per_tenant=max_checkpoint_bytes_per_tenant,
        ),
        limits=ServerLimits(
            max_samples_per_request=max_samples_per_request,
            max_sample_tokens=max_sample_tokens,
            max_batch_rows=max_batch_rows,
            max_batch_tokens=max_batch_tokens,
            body_read_timeout=body_read_timeout,
            header_read_timeout=header_read_timeout,
            max_uploads_per_tenant=max_uploads_per_tenant,
            max_chunk_group_mb=max_chunk_group_mb,
            max_long_polls_per_tenant=max_long_polls_per_tenant,
            max_openai_requests_per_tenant=max_openai_requests_per_tenant,
            max_tinker_sessions_per_tenant=max_tinker_sessions_per_tenant,
            max_pending_mb_per_tenant=max_pending_mb_per_tenant,
            max_retained_results_mb=max_retained_results_mb,
            max_json_mb=max_json_mb,
        ),
    )


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
