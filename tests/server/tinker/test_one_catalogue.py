"""Tinker's named checkpoints live in the Service's one checkpoint catalogue: the jobs API and the
Cortex API list, download and delete them as they do any checkpoint (and the Tinker API sees what
they did), a TTL that runs out deletes the checkpoint wherever it is looked at, and the records
of a server from before the catalogue (``run.json``, ``expiry.json``) are taken in at start."""

from __future__ import annotations

import json
import sqlite3
import time
import types

import httpx
import pytest

from arctic_platform.server import checkpoint_catalogue
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.cortex import PREFIX
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.tinker.conftest import ALICE, BOB, TINY, encode
from tests.server.tinker.plain_http import PROTOBUF, TinkerHttp

CORTEX = PREFIX.format(database="db", schema="sch", endpoint="ep")


def bearer(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def job_of(http: httpx.Client, model_id: str) -> str:
    """The id of a training run's job, as the jobs API lists it."""
    jobs = http.get("/jobs").json()["jobs"]
    (job,) = [j for j in jobs if j["experiment_name"] == f"tinker {model_id}"]
    return job["job_id"]


@pytest.fixture(scope="module")
def model_id(run):
    return run[1]


def test_the_jobs_and_cortex_apis_list_download_and_delete_tinker_saves(
    alice, model_id, server_url
):
    for route in ("save_weights", "save_weights_for_sampler"):
        alice.ok(alice.save(route, model_id, "shared").json()["request_id"])
    with bearer(server_url, ALICE) as http, bearer(server_url, BOB) as bob:
        job = job_of(http, model_id)
        listed = {
            c["checkpoint_id"]: c
            for c in http.get(f"/jobs/{job}/checkpoints").json()["checkpoints"]
        }
        assert listed["weights-shared"]["checkpoint_type"] == "resumable"
        assert listed["sampler_weights-shared"]["checkpoint_type"] == "weights-only"
        files = http.get(f"/jobs/{job}/checkpoints/sampler_weights-shared/files").json()
        config = next(
            f["filename"] for f in files["files"] if f["filename"].endswith("hf/config.json")
        )
        downloaded = http.get(f"/jobs/{job}/checkpoints/sampler_weights-shared/files/{config}")
        assert downloaded.status_code == 200 and "model_type" in downloaded.json()
        assert bob.get(f"/jobs/{job}/checkpoints").status_code == 404

        deleted = http.delete(f"{CORTEX}/{job}/checkpoints/weights-shared")
        assert deleted.status_code in (200, 204), deleted.text
    paths = {c["tinker_path"] for c in alice.checkpoints(model_id)}
    assert f"tinker://{model_id}/weights/shared" not in paths
    assert f"tinker://{model_id}/sampler_weights/shared" in paths
    loaded = alice.post(
        "load_weights",
        {"model_id": model_id, "path": f"tinker://{model_id}/weights/shared", "optimizer": True},
    )
    assert loaded.status_code == 404 or "error" in alice.result(loaded.json()["request_id"]).json()


def test_a_checkpoint_past_its_ttl_is_deleted_on_every_surface(
    alice, model_id, server_url, server_app, monkeypatch
):
    for name, ttl in (("brief", 3600), ("kept", None)):
        saved = alice.save("save_weights_for_sampler", model_id, name, ttl_seconds=ttl)
        alice.ok(saved.json()["request_id"])
    listed = {c["tinker_path"]: c for c in alice.checkpoints(model_id)}
    brief, kept = (f"tinker://{model_id}/sampler_weights/{n}" for n in ("brief", "kept"))
    assert listed[brief]["expires_at"] is not None and listed[kept]["expires_at"] is None
    (folder,) = server_app.state.service.paths.root.glob(
        f"*/tinker/runs/{model_id.replace(':', '_')}/sampler_weights/brief"
    )

    later = time.time() + 3601  # the catalogue's clock only: the hour has passed
    monkeypatch.setattr(checkpoint_catalogue, "time", types.SimpleNamespace(time=lambda: later))
    with bearer(server_url, ALICE) as http:
        job = job_of(http, model_id)
        ids = {
            c["checkpoint_id"] for c in http.get(f"/jobs/{job}/checkpoints").json()["checkpoints"]
        }
    assert "sampler_weights-brief" not in ids and "sampler_weights-kept" in ids
    assert not folder.exists()
    assert brief not in {c["tinker_path"] for c in alice.checkpoints(model_id)}
    gone = alice.sample(alice.session(), brief, encode("1+1="))
    assert gone.status_code == 404 and gone.json()["code"] == "not_found", gone.text


@pytest.mark.slow  # two servers, one after the other, on one data dir
def test_a_server_takes_in_the_tinker_records_of_a_server_before_the_catalogue(tmp_path):
    """The first server saves through today's code; its records are then rewritten into the
    former layout (``run.json`` and ``expiry.json`` beside the run's folders, no rows), which is
    what a server upgraded in place finds."""
    data = tmp_path / "data"

    def server():
        service = Service(ServiceSettings(data_dir=data, device="cpu"))
        return serve_app(create_app(service, auth=TokenAuth([ALICE])))

    with server() as url:
        client = TinkerHttp(url, ALICE)
        model_id = client.training_run(client.session(), TINY)
        name = "before"
        saved = client.save("save_weights_for_sampler", model_id, name, ttl_seconds=7200)
        client.ok(saved.json()["request_id"])
        (listed,) = client.checkpoints(model_id)
        client.close()

    with sqlite3.connect(data / "metadata.sqlite3") as db:
        (run,) = db.execute(
            "SELECT model_id, owner, base_model, lora_rank, created_at FROM tinker_runs"
        ).fetchall()
        (expires_at,) = db.execute("SELECT expires_at FROM checkpoints").fetchone()
        db.execute("DELETE FROM tinker_runs")
        db.execute("DELETE FROM checkpoints")
    (run_dir,) = data.glob(f"tenants/*/tinker/runs/{model_id.replace(':', '_')}")
    keys = ("model_id", "owner", "base_model", "lora_rank", "created_at")
    (run_dir / "run.json").write_text(json.dumps(dict(zip(keys, run, strict=True))))
    (run_dir / "expiry.json").write_text(json.dumps({f"sampler_weights/{name}": expires_at}))

    with server() as url:
        client = TinkerHttp(url, ALICE)
        (adopted,) = client.checkpoints(model_id)
        assert adopted["tinker_path"] == listed["tinker_path"]
        assert adopted["expires_at"] == listed["expires_at"]
        sampled = client.sample(client.session(), adopted["tinker_path"], encode("1+1="))
        assert sampled.status_code == 200 and sampled.headers["content-type"] == PROTOBUF
        client.close()
    assert not (run_dir / "run.json").exists() and not (run_dir / "expiry.json").exists()
