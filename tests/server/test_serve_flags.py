"""``arctic-platform serve`` answers a bad flag at once: before it imports torch (seconds), and
with the flag's name. A fresh interpreter per case, as a user's shell runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--placement-timeout", "0"], "--placement-timeout: must be > 0 seconds"),
        (["--sampling-engine", "tpu"], "--sampling-engine: expected torch or vllm, got 'tpu'"),
        (["--body-read-timeout", "-1"], "--body-read-timeout: must be > 0 seconds"),
        (["--header-read-timeout", "0"], "--header-read-timeout: must be > 0 seconds"),
        (["--job-idle-timeout", "0"], "--job-idle-timeout: must be > 0 seconds"),
        # These started a server that then failed (a port mod 65536, a traceback at start) or
        # failed every job later.
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--log-level", "bogus"], "--log-level: expected one of debug, info"),
        (["--device", "bogus"], "--device: expected auto, cpu, cuda or cuda:N, got 'bogus'"),
    ],
)
def test_a_bad_flag_is_refused_by_name_without_importing_torch(tmp_path, args, message):
    command = [sys.executable, "-X", "importtime", "-m", "arctic_platform.cli", "serve"]
    result = subprocess.run(
        [*command, "--data-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in " ".join((result.stdout + result.stderr).split())
    # -X importtime lists the modules imported, one per line, as "... | <module>"
    assert not re.search(r"\|\s+torch(\.\S+)?\s*$", result.stderr, re.MULTILINE)
    assert not any(tmp_path.iterdir())  # nothing started: no metadata store, no job folders


def test_a_missing_package_names_the_extra_that_installs_it_without_importing_anything():
    from arctic_platform._extras import require, require_installed

    for check in (require, require_installed):
        with pytest.raises(ImportError, match=r"pip install 'arctic-platform\[server\]'"):
            check("arctic_no_such_module", "server", purpose="arctic-platform serve")
    assert require_installed("json", "server") is None


@pytest.mark.parametrize(
    ("setting", "field", "default"),
    [
        ("limits", "max_long_polls_per_tenant", 1024),
        ("limits", "max_openai_requests_per_tenant", 4096),
        ("limits", "max_tinker_sessions_per_tenant", 256),
        ("limits", "max_pending_mb_per_tenant", 2048),
        ("limits", "max_retained_results_mb", 4096),
        ("quota", "max_jobs_per_tenant", 8),
        ("quota", "max_model_bytes_per_tenant", None),
        ("quota", "max_checkpoint_bytes_per_tenant", None),
    ],
)
def test_a_per_tenant_flag_sets_its_server_limit_or_quota(monkeypatch, setting, field, default):
    from typer.testing import CliRunner

    from arctic_platform import cli
    from arctic_platform.server import serve

    seen = []
    monkeypatch.setattr(serve, "serve", lambda **kwargs: seen.append(kwargs[setting]))
    flag = "--" + field.replace("_", "-")
    assert CliRunner().invoke(cli.app, ["serve"]).exit_code == 0
    assert CliRunner().invoke(cli.app, ["serve", flag, "5"]).exit_code == 0
    assert [getattr(values, field) for values in seen] == [default, 5]
    refused = CliRunner().invoke(cli.app, ["serve", flag, "0"])
    assert refused.exit_code == 2 and flag in refused.output
