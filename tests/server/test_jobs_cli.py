"""``arctic-platform jobs`` against a live server (real app, uvicorn on 127.0.0.1, two tenants),
and the ``/jobs`` routes it calls, bad input included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from arctic_platform.cli import app
from arctic_platform.server.auth import TokenAuth
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, TINY, job_request, make_app, sub_job
from tests.waiting import wait_until

ALICE, BOB = "alice-token", "bob-token"
ALICE_OWNER = TokenAuth([ALICE]).owner(f"Bearer {ALICE}")


@pytest.fixture
def server(service, monkeypatch):
    """The server's URL; ALICE_TOKEN, BOB_TOKEN and WRONG_TOKEN hold tokens in the env."""
    monkeypatch.setenv("ALICE_TOKEN", ALICE)
    monkeypatch.setenv("BOB_TOKEN", BOB)
    monkeypatch.setenv("WRONG_TOKEN", "not-a-token")
    with serve_app(make_app(service, tokens=[ALICE, BOB])) as url:
        yield url


def jobs(url: str, token_env: str, *args: str):
    return CliRunner().invoke(app, ["jobs", *args, "--url", url, "--token-env", token_env])


def as_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


def create_job(url: str, request: dict) -> str:
    response = httpx.post(url + CORTEX, json=request, headers=bearer(ALICE), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["job_id"]


@pytest.fixture
def alice_job(server, service) -> tuple[str, str]:
    """Alice's running training job with one saved checkpoint: (job id, checkpoint id)."""
    job_id = create_job(server, job_request("training"))
    service.wait_until_running(job_id, owner=ALICE_OWNER, timeout=120)
    saved = httpx.post(f"{server}/save?job_id={job_id}", json={}, headers=bearer(ALICE), timeout=60)
    assert saved.status_code == 200, saved.text
    return job_id, saved.json()["checkpoint_id"]


def test_list_show_checkpoints_export_logs_and_cancel(server, service, alice_job, tmp_path):
    job_id, checkpoint_id = alice_job

    listed = as_json(jobs(server, "ALICE_TOKEN", "list", "--json"))
    (job,) = listed["jobs"]
    assert (job["job_id"], job["status"], job["last_op"]) == (job_id, "running", "save")
    assert job["created_at"] <= job["last_op_at"] <= listed["now"]
    table = jobs(server, "ALICE_TOKEN", "list")
    assert table.exit_code == 0
    row = next(line for line in table.stdout.splitlines() if job_id in line)
    for cell in ("running", TINY, "save"):
        assert cell in row

    shown = as_json(jobs(server, "ALICE_TOKEN", "show", job_id, "--json"))
    assert shown["config"]["sub_job_configs"][0]["model_name"] == TINY
    assert [s["job_type"] for s in shown["sub_jobs"]] == ["training"]
    assert [c["checkpoint_id"] for c in shown["checkpoints"]] == [checkpoint_id]
    assert shown["reason"] is None
    text = jobs(server, "ALICE_TOKEN", "show", job_id).stdout
    assert checkpoint_id in text and f"{job_id}:training:0" in text and "AdamW" in text

    listed_checkpoints = as_json(jobs(server, "ALICE_TOKEN", "checkpoints", job_id, "--json"))
    assert listed_checkpoints["checkpoints"] == service.list_checkpoints(job_id, owner=ALICE_OWNER)
    assert checkpoint_id in jobs(server, "ALICE_TOKEN", "checkpoints", job_id).stdout

    out = tmp_path / "export"
    exported = as_json(
        jobs(server, "ALICE_TOKEN", "export", job_id, "--output", str(out), "--json")
    )
    on_server = service.checkpoint_files(job_id, checkpoint_id, owner=ALICE_OWNER)
    assert sorted(f["filename"] for f in exported["files"]) == [f["filename"] for f in on_server]
    for entry in on_server:
        assert (out / entry["filename"]).read_bytes() == Path(entry["path"]).read_bytes()

    logs = jobs(server, "ALICE_TOKEN", "logs", job_id)
    assert logs.exit_code == 0 and "engine ready" in logs.stdout

    cancelled = jobs(server, "ALICE_TOKEN", "cancel", job_id)
    assert cancelled.exit_code == 0 and cancelled.stdout.strip() == f"{job_id}: cancelled"
    shown = as_json(jobs(server, "ALICE_TOKEN", "show", job_id, "--json"))
    assert (shown["status"], shown["reason"]) == ("cancelled", "cancelled by the client")
    followed = jobs(server, "ALICE_TOKEN", "logs", job_id, "--follow")  # ended: returns at eof
    assert followed.exit_code == 0 and "status cancelled" in followed.stdout


def test_logs_follow_prints_new_lines_until_the_job_ends(server, service, alice_job):
    job_id, _ = alice_job
    command = ["jobs", "logs", job_id, "--follow", "--url", server, "--token-env", "ALICE_TOKEN"]
    follower = subprocess.Popen(
        [sys.executable, "-m", "arctic_platform.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = follower.stdout.readline()  # the follower is attached and printing
        assert "created with 1 sub-job" in first
        assert follower.poll() is None  # still following a running job
        service.cancel_job(job_id, owner=ALICE_OWNER)
        out, err = follower.communicate(timeout=120)
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    assert "status cancelled: cancelled by the client" in out


def test_a_failed_job_shows_its_reason(server, service):
    empty = service.paths.tenant_root(ALICE_OWNER) / "not-a-model"  # in Alice's space, no model
    empty.mkdir()
    job_id = create_job(server, {"sub_job_configs": [sub_job("training", model_name=str(empty))]})
    wait_until(
        lambda: service.get_job(job_id, owner=ALICE_OWNER)["status"] == "failed",
        what="the job did not fail",
        interval_s=0.05,
    )
    shown = as_json(jobs(server, "ALICE_TOKEN", "show", job_id, "--json"))
    assert shown["reason"].startswith("initialization failed")
    assert "initialization failed" in jobs(server, "ALICE_TOKEN", "show", job_id).stdout
    listed = as_json(jobs(server, "ALICE_TOKEN", "list", "--status", "failed", "--json"))
    assert [j["job_id"] for j in listed["jobs"]] == [job_id]


def test_a_tenant_sees_and_touches_only_its_own_jobs(server, service, alice_job, tmp_path):
    job_id, checkpoint_id = alice_job
    assert as_json(jobs(server, "BOB_TOKEN", "list", "--json"))["jobs"] == []
    for args in (
        ["show", job_id],
        ["cancel", job_id],
        ["logs", job_id],
        ["checkpoints", job_id],
        ["export", job_id, "--output", str(tmp_path / "x"), "--checkpoint", checkpoint_id],
    ):
        result = jobs(server, "BOB_TOKEN", *args)
        assert result.exit_code == 1, args
        assert f"job {job_id!r} not found" in result.stderr, args
    assert not (tmp_path / "x").exists()
    assert service.get_job(job_id, owner=ALICE_OWNER)["status"] == "running"  # not cancelled


def test_bad_ids_tokens_and_options_are_clear_errors(server, alice_job, tmp_path, monkeypatch):
    job_id, _ = alice_job
    for args in (["show", "nope"], ["cancel", "nope"], ["logs", "nope"], ["checkpoints", "x/y"]):
        result = jobs(server, "ALICE_TOKEN", *args)
        assert result.exit_code == 1 and "not found" in result.stderr.lower(), args
    result = jobs(server, "ALICE_TOKEN", "export", job_id, "--output", "o", "--checkpoint", "nope")
    assert result.exit_code == 1 and "checkpoint 'nope' not found" in result.stderr

    result = jobs(server, "WRONG_TOKEN", "list")
    assert result.exit_code == 1 and "invalid token" in result.stderr
    monkeypatch.delenv("ALICE_TOKEN")
    result = jobs(server, "ALICE_TOKEN", "list")
    assert result.exit_code == 2 and "ALICE_TOKEN" in result.stderr
    result = CliRunner().invoke(app, ["jobs", "list", "--url", server])
    assert result.exit_code == 1 and "missing bearer token" in result.stderr
    result = CliRunner().invoke(app, ["jobs", "list"])
    assert result.exit_code == 2 and "--url or --config" in result.stderr
    result = jobs(server, "BOB_TOKEN", "list", "--status", "sleeping")
    assert result.exit_code == 1 and "status: unknown job state 'sleeping'" in result.stderr

    dead = CliRunner().invoke(app, ["jobs", "list", "--url", "http://127.0.0.1:9"])
    assert dead.exit_code == 1 and "cannot reach http://127.0.0.1:9" in dead.stderr


def test_the_server_can_come_from_a_client_or_recipe_yaml(server, alice_job, tmp_path):
    job_id, _ = alice_job
    client_yaml = tmp_path / "client.yaml"
    client_yaml.write_text(
        f"model: {TINY}\nbackend: {{type: http, url: '{server}', token_env: ALICE_TOKEN}}\n"
    )
    recipe_yaml = tmp_path / "recipe.yaml"
    recipe_yaml.write_text(
        f"client:\n  model: {TINY}\n  backend: {{type: http, url: '{server}', "
        "token_env: BOB_TOKEN}\n"
    )
    for path, expected in ((client_yaml, [job_id]), (recipe_yaml, [])):
        result = CliRunner().invoke(app, ["jobs", "list", "--config", str(path), "--json"])
        assert [j["job_id"] for j in as_json(result)["jobs"]] == expected
    # --token-env overrides the YAML's.
    result = CliRunner().invoke(
        app, ["jobs", "list", "--config", str(recipe_yaml), "--token-env", "ALICE_TOKEN", "--json"]
    )
    assert [j["job_id"] for j in as_json(result)["jobs"]] == [job_id]

    local = tmp_path / "inprocess.yaml"
    local.write_text(f"model: {TINY}\nbackend: {{type: inprocess}}\n")
    result = CliRunner().invoke(app, ["jobs", "list", "--config", str(local)])
    assert result.exit_code == 2 and "backend type http or cortex" in result.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text(f"model: {TINY}\nbackend: {{type: http, ulr: 'http://h'}}\n")
    result = CliRunner().invoke(app, ["jobs", "list", "--config", str(typo)])
    assert result.exit_code == 2 and "ulr" in result.stderr


def test_jobs_routes_reject_bad_input_without_touching_jobs(server, service, alice_job):
    job_id, checkpoint_id = alice_job
    with httpx.Client(base_url=server, headers=bearer(ALICE), timeout=60) as http:
        assert httpx.get(f"{server}/jobs").status_code == 401
        bad = http.get("/jobs", params={"status": "sleeping"})
        assert bad.status_code == 400 and "status" in bad.json()["message"]
        bad = http.get(f"/jobs/{job_id}/logs", params={"max_lines": 0})
        assert bad.status_code == 400 and bad.json()["field"] == "max_lines"
        bad = http.get(f"/jobs/{job_id}/logs", params={"cursor": "abc"})
        assert bad.status_code == 400 and "cursor" in bad.json()["message"]
        files = http.get(f"/jobs/{job_id}/checkpoints/{checkpoint_id}/files").json()["files"]
        assert files and all(set(f) == {"filename", "size_bytes"} for f in files)  # no paths
        base = f"/jobs/{job_id}/checkpoints/{checkpoint_id}/files/"
        for name in ("..%2F..%2Fmetadata.sqlite3", "%2Fetc%2Fpasswd", "missing.bin"):
            assert http.get(base + name).status_code == 404, name
        good = http.get(base + files[0]["filename"])
        assert good.status_code == 200 and len(good.content) == files[0]["size_bytes"]
        assert http.post("/jobs/nope/cancel").status_code == 404
    assert service.get_job(job_id, owner=ALICE_OWNER)["status"] == "running"


def test_a_cortex_backend_yaml_manages_jobs_through_the_cortex_api(
    server, service, alice_job, tmp_path
):
    job_id, checkpoint_id = alice_job
    config = tmp_path / "cortex.yaml"
    config.write_text(
        f"model: {TINY}\nbackend: {{type: cortex, base_url: '{server}', database: DB, "
        "schema: RL, pat_env_var: ALICE_TOKEN}\n"
    )

    def cortex_jobs(*args: str):
        return CliRunner().invoke(app, ["jobs", *args, "--config", str(config)])

    (job,) = as_json(cortex_jobs("list", "--json"))["jobs"]
    assert (job["job_id"], job["status"], job["last_op"]) == (job_id, "running", "save")
    shown = as_json(cortex_jobs("show", job_id, "--json"))
    assert shown["config"] is None  # the Cortex API does not return the create request
    assert [c["checkpoint_id"] for c in shown["checkpoints"]] == [checkpoint_id]
    assert checkpoint_id in cortex_jobs("show", job_id).stdout
    assert "engine ready" in cortex_jobs("logs", job_id).stdout

    out = tmp_path / "export"
    exported = as_json(cortex_jobs("export", job_id, "--output", str(out), "--json"))["files"]
    on_server = service.checkpoint_files(job_id, checkpoint_id, owner=ALICE_OWNER)
    assert sorted(f["filename"] for f in exported) == [f["filename"] for f in on_server]
    for entry in on_server:
        assert (out / entry["filename"]).read_bytes() == Path(entry["path"]).read_bytes()

    assert cortex_jobs("show", "nope").exit_code == 1
    result = cortex_jobs("list", "--url", server)
    assert result.exit_code == 2 and "not with a cortex backend" in result.stderr
    assert cortex_jobs("cancel", job_id).stdout.strip() == f"{job_id}: cancelled"
    assert service.get_job(job_id, owner=ALICE_OWNER)["status"] == "cancelled"


def test_the_jobs_cli_needs_only_the_client_extra(server, alice_job):
    """torch, FastAPI, uvicorn and Ray unimportable: `jobs list` still works."""
    from tests.client.test_client_only_install import BLOCK_HEAVY

    job_id, _ = alice_job
    script = BLOCK_HEAVY + "\nfrom arctic_platform.cli import main\nmain()\n"
    command = ["jobs", "list", "--url", server, "--token-env", "ALICE_TOKEN", "--json"]
    listed = subprocess.run(
        [sys.executable, "-c", script, *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert [j["job_id"] for j in json.loads(listed.stdout)["jobs"]] == [job_id]
