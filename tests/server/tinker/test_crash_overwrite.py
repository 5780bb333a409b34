"""A real ``arctic-platform serve`` killed with SIGKILL while it overwrites a Tinker checkpoint
(after an acknowledged overwrite of it): after a restart the checkpoint is listed, loads and
samples, and it is the acknowledged version, never the half-written one nor none, and nothing
half-written is visible. The kill lands at a point seen on disk (the new version's staging folder
appearing), not after a guessed delay."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.live_server import kill_when, serve_process
from tests.server.tinker.conftest import ALICE, TINY, encode
from tests.server.tinker.plain_http import PROTOBUF, TinkerHttp

pytestmark = pytest.mark.slow

TOKENS = "ARCTIC_TEST_TINKER_TOKENS"
SERVE = ("--token-env", TOKENS)
ENV = {TOKENS: ALICE}
PROMPT = encode("12+34=")


def leftovers(folder: Path) -> list[Path]:
    """Staging (``.tmp-``) and replaced (``.old-``) folders of saves under ``folder`` (read
    while the server writes there: ``os.walk`` skips what vanishes under it)."""
    return [
        Path(parent) / name
        for parent, folders, _ in os.walk(folder)
        for name in folders
        if name.startswith((".tmp-", ".old-"))
    ]


def published_anew(folder: Path, old_inode: int) -> bool:
    """Whether a complete new version of ``folder`` is in place (the overwrite finished)."""
    try:
        return folder.stat().st_ino != old_inode and (folder / "latest").is_file()
    except FileNotFoundError:
        return False


def sampler_folder(data: Path, model_id: str, name: str) -> Path:
    (runs,) = (data / "tenants").glob(f"*/tinker/runs/{model_id.replace(':', '_')}")
    return runs / "sampler_weights" / name


def check_loadable(url: str, model_id: str, name: str) -> None:
    """``name`` is listed and a new sampling client on it samples."""
    client = TinkerHttp(url, ALICE)
    try:
        path = f"tinker://{model_id}/sampler_weights/{name}"
        assert path in {c["tinker_path"] for c in client.checkpoints(model_id)}
        sampled = client.sample(client.session(), path, PROMPT)
        assert sampled.status_code == 200, sampled.text
        assert sampled.headers["content-type"] == PROTOBUF, sampled.text
    finally:
        client.close()


def test_a_server_killed_while_it_overwrites_keeps_the_acknowledged_version(tmp_path):
    data = tmp_path / "data"
    with serve_process(data, *SERVE, env=ENV) as (process, url):
        client = TinkerHttp(url, ALICE)
        run = client.training_run(client.session(), TINY)
        for _ in range(2):  # a save, then an acknowledged overwrite
            client.ok(client.save("save_weights_for_sampler", run, "s1").json()["request_id"])
        folder = sampler_folder(data, run, "s1")
        acknowledged = folder.stat().st_ino
        killed = False
        for _ in range(5):  # a save may finish between two looks; then overwrite again
            reply = client.save("save_weights_for_sampler", run, "s1").json()
            killed = kill_when(
                process,
                lambda: bool(leftovers(folder.parent)),
                give_up=lambda old=acknowledged: published_anew(folder, old),
            )
            if killed:
                break
            client.ok(reply["request_id"])
            acknowledged = folder.stat().st_ino
        assert killed, "no overwrite was caught while its new version was being written"
        client.close()

    with serve_process(data, *SERVE, env=ENV) as (process, url):
        # The last acknowledged version, complete; the killed save's staging folder is gone.
        assert folder.stat().st_ino == acknowledged
        assert leftovers(data) == []
        check_loadable(url, run, "s1")
