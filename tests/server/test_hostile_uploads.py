"""Uploads from clients that lie, stall or vanish, against the real server over 127.0.0.1.

A connection that claims a large Content-Length and sends a few bytes holds no more memory than
it sent and is closed with 408 after ``--body-read-timeout``; a tenant has at most
``--max-uploads-per-tenant`` bodies partly sent at once (429 ``limit_exceeded``) and at most
``--max-chunk-group-mb`` held in incomplete Cortex chunk groups (413 ``limit_exceeded``); a client
that disconnects mid-upload is one access-log line with status 499, not a 500 with a traceback.
The raw sockets are what a hostile client sends; httpx would never send a lying body.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from arctic_platform import cli, wire
from arctic_platform.server.async_requests import GROUP_BYTES, ChunkGroups
from arctic_platform.server.errors import ServiceError
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.tinker import proto
from tests.live_server import serve_app, serve_process
from tests.server.conftest import CORTEX, OCTET, job_request, make_app
from tests.waiting import wait_until

MIB = 1024 * 1024
ALICE, BOB = "tml-alice", "tml-bob"
CLAIMED = 255 * MIB  # under the default 256 MiB body limit: accepted, then never sent
# Bodies on each API: the on-prem op route, Cortex JSON ops and job creation, Tinker's protobuf
# forward_backward (all read through server/http_common.read_body).
UPLOAD_ROUTES = [
    ("/forward-backward?job_id=nojob", "application/octet-stream"),
    (f"{CORTEX}/nojob/operation", "application/json"),
    (CORTEX, "application/json"),
    ("/api/v1/forward_backward", proto.CONTENT_TYPE),
]


def credentials(token: str | None) -> dict:
    """Both credential headers: on-prem and Cortex read Authorization, Tinker X-API-Key."""
    return {} if token is None else {"authorization": f"Bearer {token}", "x-api-key": token}


def lying_upload(
    url: str, path: str, content_type: str, *, claimed: int, token: str | None = None
) -> socket.socket:
    """A connection that declares ``claimed`` body bytes and sends 10."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    headers = {
        "host": parts.netloc,
        "content-type": content_type,
        "content-length": str(claimed),
        **credentials(token),
    }
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(head.encode() + b"\r\n" + b"0123456789")
    return sock


def answer_of(sock: socket.socket, *, within: float) -> tuple[bytes, bool]:
    """What the server sent until it closed the connection, and whether it closed it within
    ``within`` seconds."""
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        pass
    return data, True


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) afresh (Linux: writing 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


@contextmanager
def serving(tmp_path, tokens=(), **options):
    """A Service with ``options`` split between its ServerLimits and the app."""
    limit_names = set(ServerLimits.__dataclass_fields__)
    limits = ServerLimits(**{k: v for k, v in options.items() if k in limit_names})
    service = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=limits))
    app_options = {k: v for k, v in options.items() if k not in limit_names}
    try:
        with serve_app(make_app(service, tokens=tokens, **app_options)) as url:
            yield service, url
    finally:
        service.close()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_lying_content_lengths_hold_only_what_arrived_and_time_out_with_408(tmp_path):
    with serving(tmp_path, tokens=[ALICE, BOB], body_read_timeout=1.0) as (_, url):
        reset_peak_rss()
        before = rss_kib("VmHWM")
        with ExitStack() as stack:
            socks = []
            for i, (path, content_type) in enumerate(UPLOAD_ROUTES):
                token = (ALICE, BOB)[i % 2]  # two per tenant: within the default upload cap
                sock = lying_upload(url, path, content_type, claimed=CLAIMED, token=token)
                socks.append(stack.enter_context(sock))
            deadline = time.monotonic() + 30
            answers = [answer_of(s, within=max(0.1, deadline - time.monotonic())) for s in socks]
        grown_mib = (rss_kib("VmHWM") - before) / 1024
        declared_mib = len(UPLOAD_ROUTES) * CLAIMED / MIB
        assert grown_mib < 50, f"peak RSS grew {grown_mib:.0f} MiB for {declared_mib:.0f} declared"
        for (path, _), (raw, closed) in zip(UPLOAD_ROUTES, answers, strict=True):
            assert closed, f"{path}: the server never closed a stalled upload ({raw[:200]!r})"
            status, body = status_and_body(raw)
            assert status == 408, (path, raw[:300])
            assert body["code"] == "request_timeout"
            assert "--body-read-timeout" in body["message"] and "10 of" in body["message"]
        assert httpx.get(f"{url}/health").status_code == 200


def partial_upload_answer(url: str, token: str | None = None) -> tuple[int, dict] | None:
    """What a body sent in part (10 bytes of a MiB) gets at once: ``(status, body)`` when the
    server refuses it (429 while the tenant's upload slots are full), None when the server took
    it and waits for the rest (the connection is then closed, which gives the slot back)."""
    sock = lying_upload(
        url, f"{CORTEX}/nojob/operation", "application/json", claimed=MIB, token=token
    )
    raw, _ = answer_of(sock, within=1.0)
    sock.close()
    return status_and_body(raw) if raw else None


def test_a_tenant_has_at_most_max_uploads_per_tenant_bodies_partly_sent(tmp_path):
    probe = f"{CORTEX}/nojob/operation"  # reads its body, then answers 400 (no operation_type)
    with (
        serving(tmp_path, tokens=[ALICE, BOB], max_uploads_per_tenant=2) as (_, url),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        stalled = [
            lying_upload(url, path, kind, claimed=MIB, token=ALICE)
            for path, kind in (UPLOAD_ROUTES[0], UPLOAD_ROUTES[3])  # on-prem and Tinker
        ]
        try:
            status, body = wait_until(
                lambda: partial_upload_answer(url, ALICE),
                what="a third partly sent body was never refused",
                timeout_s=30,
            )
            assert status == 429, body
            assert body["code"] == "limit_exceeded" and body["limit"] == "max_uploads_per_tenant"
            assert body["maximum"] == 2 and "--max-uploads-per-tenant" in body["message"]
            # A body that arrives whole holds no slot: small requests go on being answered (an
            # RL loop's burst of hundreds of small requests is never refused for the limit).
            for _ in range(5):
                assert http.post(probe, json={}, headers=credentials(ALICE)).status_code == 400
            # Another tenant is not held up by Alice's uploads.
            assert partial_upload_answer(url, BOB) is None
        finally:
            stalled[0].close()
        # A closed upload gives its slot back.
        wait_until(
            lambda: partial_upload_answer(url, ALICE) is None,
            what="a disconnected upload kept its slot",
            timeout_s=30,
        )
        stalled[1].close()


def test_a_connection_waiting_for_its_first_body_bytes_holds_no_upload_slot(tmp_path):
    """Headers sent, body not yet: nothing of the body is held, so the tenant's other requests
    are not refused for it (its body read deadline still applies)."""
    with serving(tmp_path, tokens=[ALICE], max_uploads_per_tenant=1) as (_, url):
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        head = (
            f"POST {CORTEX}/nojob/operation HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            f"content-type: application/json\r\ncontent-length: 2\r\n"
            f"authorization: Bearer {ALICE}\r\n\r\n"
        )
        sock.sendall(head.encode())
        try:
            assert partial_upload_answer(url, ALICE) is None  # admitted: the slot was free
            sock.sendall(b"{}")
            raw, _ = answer_of(sock, within=30)
            assert status_and_body(raw)[0] == 400  # the late body was read and answered
        finally:
            sock.close()


def group_chunks(size: int, *, group: str, max_bytes: int) -> list[bytes]:
    frame = wire.dumps({"batch": {"x": np.full(size, 7, np.uint8)}})
    return wire.encode_byte_chunks(
        frame, kind="request", max_bytes=max_bytes, chunk_group_id=group, force_chunk=True
    )


def test_bytes_in_incomplete_chunk_groups_are_capped_per_tenant(tmp_path):
    with (
        serving(tmp_path, tokens=[ALICE, BOB], max_chunk_group_mb=1) as (service, url),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        jobs = {}
        for token in (ALICE, BOB):
            created = http.post(CORTEX, json=job_request("training"), headers=credentials(token))
            jobs[token] = created.json()["job_id"]

        def post(token: str, chunk: bytes) -> httpx.Response:
            route = f"{CORTEX}/{jobs[token]}/forward-backward"
            return http.post(route, content=chunk, headers={**OCTET, **credentials(token)})

        first = group_chunks(900_000, group="g1", max_bytes=700_000)
        second = group_chunks(900_000, group="g2", max_bytes=700_000)
        assert post(ALICE, first[0]).status_code == 200
        refused = post(ALICE, second[0])  # 429: the first group completing makes room
        assert refused.status_code == 429, refused.text
        body = refused.json()
        assert body["code"] == "limit_exceeded" and body["limit"] == "max_chunk_group_mb"
        assert "--max-chunk-group-mb" in body["message"]
        assert body["maximum"] == MIB and body["value"] > MIB
        # Bob's bytes are his own; a refused chunk left Alice's held bytes as they were.
        assert post(BOB, second[0]).status_code == 200
        owner = service.owner_of(jobs[ALICE])
        assert service.chunk_groups.held_bytes(owner) == len(first[0]) + GROUP_BYTES
        # A frame declared above the cap is refused at its first chunk.
        too_big = group_chunks(2 * MIB, group="big", max_bytes=400_000)
        assert post(ALICE, too_big[0]).status_code == 413
        # A completed group releases its bytes (whatever its op then makes of the frame).
        for chunk in first[1:]:
            assert post(ALICE, chunk).status_code < 500
        assert service.chunk_groups.held_bytes(owner) == 0
        assert post(ALICE, second[0]).status_code == 200


def test_an_abandoned_chunk_group_is_expired_and_its_bytes_counted_down():
    groups = ChunkGroups(limits=ServerLimits(max_chunk_group_mb=1))
    chunks = group_chunks(600_000, group="gone", max_bytes=400_000)
    groups.receive("job", chunks[0], owner="alice")
    assert groups.held_bytes("alice") == len(chunks[0]) + GROUP_BYTES
    assert groups.expire_stale(time.time() - 1) == []  # touched after the cutoff: kept
    assert groups.expire_stale(time.time() + 1) == ["gone"]
    assert groups.held_bytes("alice") == 0
    # The whole cap is free again, and the group itself is gone (its next chunk restarts it).
    other = group_chunks(900_000, group="next", max_bytes=600_000)
    assert groups.receive("job", other[0], owner="alice").received == 1
    with pytest.raises(Exception, match="restart it from chunk 0"):
        groups.receive("job", chunks[1], owner="alice")


def test_many_small_groups_count_what_each_group_holds():
    """Groups of one small chunk each were counted by their chunks' bytes alone, while each
    held about 3.3 KB more (its record, digests, event): 20,000 of them took 64 MiB and
    counted 8. Each now counts ``GROUP_BYTES`` besides its chunks, so the cap holds."""
    groups = ChunkGroups(limits=ServerLimits(max_chunk_group_mb=1))
    accepted = 0
    with pytest.raises(ServiceError) as refused:
        for i in range(MIB // 100):
            groups.receive("job", group_chunks(2_000, group=f"g{i}", max_bytes=1_500)[0], owner="a")
            accepted += 1
    assert refused.value.status == 429
    assert accepted < MIB // GROUP_BYTES
    assert groups.held_bytes("a") <= MIB


def test_a_group_that_cannot_fit_alone_is_dropped_when_its_chunks_show_it():
    """A frame declared just under the cap whose chunks, headers included, pass it: the chunk
    that does is a 413, and the group goes with what it held (the client gives up on a 413)."""
    groups = ChunkGroups(limits=ServerLimits(max_chunk_group_mb=1))
    chunks = group_chunks(MIB - 20_000, group="tight", max_bytes=4096)
    assert sum(len(c) for c in chunks) > MIB  # the headers pass the cap
    with pytest.raises(ServiceError) as refused:
        for chunk in chunks:
            groups.receive("job", chunk, owner="alice")
    assert refused.value.status == 413
    assert groups.held_bytes("alice") == 0
    with pytest.raises(Exception, match="restart it from chunk 0"):
        groups.receive("job", chunks[-1], owner="alice")


def test_a_group_refused_for_now_is_submitted_again_only_by_its_last_chunk():
    """A group whose frame got 429 (``unschedule``) keeps its chunks: a client restarting the
    group resends chunk 0 first, which is only acknowledged (the client expects the request id
    from the last chunk), and the last chunk hands the frame over again."""
    groups = ChunkGroups(limits=ServerLimits())
    chunks = group_chunks(600_000, group="g", max_bytes=200_000)
    for chunk in chunks[:-1]:
        assert groups.receive("job", chunk, owner="alice").frame is None
    whole = groups.receive("job", chunks[-1], owner="alice")
    assert whole.frame is not None
    groups.unschedule("job", "g")  # its submit got 429
    assert groups.held_bytes("alice") == sum(len(c) for c in chunks) + GROUP_BYTES  # kept
    restart = groups.receive("job", chunks[0], owner="alice")
    assert restart.frame is None and restart.request_id is None
    again = groups.receive("job", chunks[-1], owner="alice")
    assert again.frame == whole.frame
    groups.completed("job", "g", "r1")
    assert groups.receive("job", chunks[0], owner="alice").request_id == "r1"


@pytest.fixture
def server_logs(caplog):
    """Every record of our loggers and uvicorn's (which does not propagate to the root)."""
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    yield caplog
    uvicorn_logger.removeHandler(caplog.handler)


def test_a_disconnect_mid_upload_is_one_log_line_with_status_499(tmp_path, server_logs):
    def ours() -> list[logging.LogRecord]:
        loggers = ("arctic_platform", "uvicorn")
        return [r for r in server_logs.records if r.name.split(".")[0] in loggers]

    with serving(tmp_path) as (_, url):
        for path, content_type in UPLOAD_ROUTES:
            server_logs.clear()
            lying_upload(url, path, content_type, claimed=100_000).close()
            wait_until(ours, what=f"{path}: nothing logged", timeout_s=30, interval_s=0.01)
            # The upload's task logs all it logs in the loop turn that ends it; a request
            # answered after that turn bounds the wait for anything else it might log.
            assert httpx.get(f"{url}/health").status_code == 200
            records = [r for r in ours() if '"/health"' not in r.getMessage()]
            assert len(records) == 1, [r.getMessage()[:300] for r in records]
            assert records[0].name == "arctic_platform.access"
            assert json.loads(records[0].getMessage())["status"] == 499, path
            assert not records[0].exc_info and records[0].levelno < logging.ERROR


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--body-read-timeout", "0"),
        ("--body-read-timeout", "soon"),
        ("--max-uploads-per-tenant", "0"),
        ("--max-chunk-group-mb", "-1"),
    ],
)
def test_serve_refuses_bad_upload_flags_naming_them(flag, value):
    result = CliRunner().invoke(cli.app, ["serve", flag, value])
    assert result.exit_code == 2
    assert "Invalid value" in result.output and flag in result.output


def test_serve_help_lists_the_upload_flags():
    result = CliRunner().invoke(cli.app, ["serve", "--help"], env={"COLUMNS": "200"})
    for flag in ("--body-read-timeout", "--max-uploads-per-tenant", "--max-chunk-group-mb"):
        assert flag in result.output


def process_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_the_upload_flags_reach_a_serve_process(tmp_path):
    flags = ("--body-read-timeout", "1", "--max-uploads-per-tenant", "1")
    with (
        serve_process(tmp_path, *flags, "--max-chunk-group-mb", "1") as (process, url),
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        before = process_rss_kib(process.pid)
        sock = lying_upload(url, *UPLOAD_ROUTES[0], claimed=CLAIMED)

        status, body = wait_until(
            lambda: partial_upload_answer(url), what="a second upload never refused", timeout_s=30
        )
        assert status == 429 and "--max-uploads-per-tenant" in body["message"]
        grown_mib = (process_rss_kib(process.pid) - before) / 1024
        raw, closed = answer_of(sock, within=30)
        sock.close()
        assert grown_mib < 50, f"server RSS grew {grown_mib:.0f} MiB for a 255 MiB claim"
        assert closed and status_and_body(raw)[0] == 408, raw[:300]
        job_id = http.post(CORTEX, json=job_request("training")).json()["job_id"]
        big = group_chunks(2 * MIB, group="big", max_bytes=400_000)
        refused = http.post(f"{CORTEX}/{job_id}/forward-backward", content=big[0], headers=OCTET)
        assert refused.status_code == 413 and refused.json()["limit"] == "max_chunk_group_mb"
