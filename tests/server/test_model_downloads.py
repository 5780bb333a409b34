"""A model hub that hangs holds up only the job that downloads from it, and that job fails with a
reason naming the hub's timeout (no other tenant's job creation waits for it)."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
from huggingface_hub import constants

from arctic_platform.engine.model_files import files_to_fetch
from arctic_platform.server.errors import Conflict
from arctic_platform.server.service import Service, ServiceSettings
from tests.server.conftest import job_request, sub_job
from tests.waiting import wait_until


class SilentHub:
    """A loopback socket that accepts connections and never answers (a hung hub endpoint)."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # closed
            if self._closed.is_set():  # a client's retry that raced the close
                connection.close()
                return
            self.connections.append(connection)

    def close(self) -> None:
        """Close the listener and every held connection: the clients' reads end at once.

        The listener is shut down before it is closed: closing alone does not wake the accept
        blocked in the other thread on Linux, which would go on accepting (and holding) a
        client's retry."""
        self._closed.set()
        with contextlib.suppress(OSError):  # not listening any more: nothing to wake
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        for connection in list(self.connections):
            connection.close()


@pytest.fixture
def silent_hub(monkeypatch):
    """The hub endpoint pointed at a :class:`SilentHub`, online (only for this test)."""
    hub = SilentHub()
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield hub
    hub.close()


def status_of(service: Service, job_id: str, owner: str) -> str:
    return service.get_job(job_id, owner=owner)["status"]


def test_a_hung_download_holds_up_only_its_own_job(tmp_path, silent_hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 600)  # hangs for this whole phase
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    try:
        hub_job = {"sub_job_configs": [sub_job("sampling", model_name="some-org/some-model")]}
        hung = service.create_job(hub_job, owner="alice")["job_id"]
        wait_until(
            lambda: silent_hub.connections, what="the job never asked the hub", interval_s=0.05
        )
        other = service.create_job(job_request("sampling"), owner="bob")["job_id"]
        service.wait_until_running(other, owner="bob", timeout=120)
        assert status_of(service, hung, "alice") == "initializing"  # still waiting on the hub
        silent_hub.close()  # the hub goes away: the hung job fails, nothing else changes
        wait_until(
            lambda: status_of(service, hung, "alice") == "failed",
            what="the hung job went on",
            interval_s=0.05,
        )
        assert status_of(service, other, "bob") == "running"
    finally:
        service.close()


def test_a_hub_that_does_not_answer_fails_the_job_naming_the_timeout(tmp_path, silent_hub):
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    try:
        constants_timeout = 0.5
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", constants_timeout)
            hub_job = {"sub_job_configs": [sub_job("sampling", model_name="some-org/some-model")]}
            job_id = service.create_job(hub_job)["job_id"]
            with pytest.raises(Conflict, match="initialization failed"):
                service.wait_until_running(job_id, timeout=120)
        reason = service.get_job(job_id)["reason"]
        assert f"did not answer within {constants_timeout:g} s (HF_HUB_ETAG_TIMEOUT)" in reason
        assert silent_hub.url in reason and "some-org/some-model" in reason
    finally:
        service.close()


def test_only_the_files_from_pretrained_reads_are_fetched():
    repo = [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "tokenizer.json",
        "flax_model.msgpack",
        "onnx/model.onnx",
        "original/consolidated.pth",
    ]
    assert files_to_fetch(repo) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert files_to_fetch(["config.json", "pytorch_model.bin"]) == [
        "config.json",
        "pytorch_model.bin",
    ]
