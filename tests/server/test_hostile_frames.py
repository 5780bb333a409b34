"""Bodies that cost the server far more than their size: a DSSST1 header declaring hundreds of
thousands of empty tensors, JSON (bodies and frame headers) beyond ``--max-json-mb``, JSON nested
or numbered beyond what Python parses. Each is refused (400 naming the cap, 413
``limit_exceeded`` naming the limit and its flag) with little memory, and decoding a large valid
body runs off the event loop, so other tenants' requests are answered meanwhile.

The servers run in this process over 127.0.0.1; each holds one training job (the Cortex data
plane looks its job up before reading a body), which none of these requests reaches.
"""

from __future__ import annotations

import json
import struct
import threading

import httpx
import numpy as np
import pytest

from arctic_platform import wire
from arctic_platform.server import http_common
from arctic_platform.server.limits import MIB, ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, job_request, make_app
from tests.server.helpers import peak_growth_mib

# A small JSON limit for the module's second server, so its tests need no 64 MiB bodies.
SMALL_JSON = ServerLimits(max_json_mb=1)
TINKER = "/api/v1"


def _server(tmp_path_factory, limits: ServerLimits):
    data = tmp_path_factory.mktemp("hostile-frames")
    service = Service(ServiceSettings(data_dir=data, device="cpu", limits=limits))
    job_id = service.create_job(job_request("training"))["job_id"]
    service.wait_until_running(job_id, timeout=120)
    with serve_app(make_app(service)) as url, httpx.Client(base_url=url, timeout=120) as client:
        client.job_id = job_id
        yield client
    service.close()


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    """A server with the default limits."""
    yield from _server(tmp_path_factory, ServerLimits())


@pytest.fixture(scope="module")
def small_json(tmp_path_factory):
    """A server whose ``max_json_mb`` is 1."""
    yield from _server(tmp_path_factory, SMALL_JSON)


def empty_tensors_frame(count: int) -> bytes:
    header = {"__metadata__": {"dss": json.dumps({"v": "DSSST1", "tree": ["j", None]})}}
    for i in range(count):
        header[f"t{i}"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@pytest.mark.slow  # a 36 MB header of 650 k entries, built once and sent four times
def test_a_header_of_650k_empty_tensors_is_a_400_naming_the_cap_with_little_memory(http):
    frame = empty_tensors_frame(650_000)
    body_mib = len(frame) / MIB
    job = http.job_id
    for route in ("/forward-backward?job_id=nope:training:0", f"{CORTEX}/{job}/forward-backward"):
        for _ in range(2):
            answer, grew = peak_growth_mib(
                lambda r=route: http.post(r, content=frame, headers=OCTET)
            )
            assert answer.status_code == 400, answer.text
            message = answer.json()["message"]
            assert f"more than {wire.MAX_FRAME_TENSORS} tensors" in message, message
        # Decoded whole it cost 774 MiB; refused at the cap it costs the body, its text and
        # the cap's worth of entries. The bound is checked on the repeat: the first large
        # decode also grows the allocator's arenas once (170-190 MiB on the 2-core machine,
        # 60-100 MiB for the same request after it), which a repeated attack does not.
        assert grew < 2 * body_mib + 100, f"peak RSS rose {grew:.0f} MiB, body {body_mib:.0f} MiB"


def test_other_requests_are_answered_while_a_large_body_decodes(http, monkeypatch):
    """Test seam: ``http_common.decode_frame`` (what routes call through ``frame_of``) is
    wrapped to block on an Event, so the test knows a decode is in progress and for how long."""
    entered, release = threading.Event(), threading.Event()
    decode = http_common.decode_frame

    def blocking_decode(*args, **kwargs):
        entered.set()
        release.wait(60)
        return decode(*args, **kwargs)

    monkeypatch.setattr(http_common, "decode_frame", blocking_decode)
    frame = wire.dumps({"batch": {"x": np.ones(4 * http_common.DECODE_ON_LOOP_BYTES, np.uint8)}})
    statuses = []
    # on-prem decodes before it looks the job up (404); Cortex after (the chunk is its own frame)
    routes = ["/forward-backward?job_id=nope:training:0", f"{CORTEX}/{http.job_id}/generate"]
    for route in routes:
        entered.clear()
        release.clear()
        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda r=route, out=answers: out.append(
                http.post(r, content=frame, headers=OCTET)
            )
        )
        sender.start()
        try:
            assert entered.wait(60), f"{route}: the decoder was never called"
            # The event loop is free: another request is answered while the decode blocks.
            with httpx.Client(base_url=http.base_url, timeout=30) as other:
                assert other.get("/health").status_code == 200
            assert not answers, "the op answered before its decode finished"
        finally:
            release.set()
            sender.join(60)
        statuses.append(answers[0].status_code)
    assert statuses == [404, 400]


def json_of_size(nbytes: int) -> bytes:
    return json.dumps({"prompts": ["x" * nbytes]}).encode()


def test_json_bodies_over_the_json_limit_are_413s_naming_limit_and_flag(small_json):
    body = json_of_size(SMALL_JSON.max_json_mb * MIB + 1)
    routes = [
        "/initialize",
        "/generate?job_id=j:sampling:0",
        f"{CORTEX}/{small_json.job_id}/generate-stream",
        CORTEX,
        f"{TINKER}/create_model",
        f"{TINKER}/asample",
    ]
    for route in routes:
        answer = small_json.post(route, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 413, (route, answer.text)
        refusal = answer.json()
        assert (refusal["code"], refusal["limit"]) == ("limit_exceeded", "max_json_mb"), route
        assert "--max-json-mb" in refusal["message"] and refusal["value"] == len(body)


def test_a_dssst1_header_over_the_json_limit_is_a_413_on_every_frame_route(small_json):
    prompts = ["x" * (SMALL_JSON.max_json_mb * MIB)]  # in the header's structure tree
    frame = wire.dumps({"prompts": prompts, "sampling_params": {"max_tokens": 1}})
    chunks = wire.encode_byte_chunks(frame, kind="request", force_chunk=True)
    routes = [
        ("/generate?job_id=j:sampling:0", frame),
        (f"{CORTEX}/{small_json.job_id}/generate", frame),
        (f"{CORTEX}/{small_json.job_id}/generate", chunks[0]),
    ]
    for route, body in routes:
        answer = small_json.post(route, content=body, headers=OCTET)
        assert answer.status_code == 413, (route, answer.text)
        assert answer.json()["limit"] == "max_json_mb"
        assert "DSSST1 header" in answer.json()["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[" * 100_000, "nests too deeply"),
        (b'{"n": ' + b"9" * 5000 + b"}", "4300 digits"),
        (b'{"a": "\xff"}', "malformed JSON"),
    ],
)
def test_json_python_cannot_parse_is_a_400_on_every_api(http, body, says):
    routes = ["/initialize", CORTEX, f"{CORTEX}/{http.job_id}/generate-stream", f"{TINKER}/asample"]
    for route in routes:
        answer = http.post(route, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400, (route, answer.text)
        assert says in answer.json()["message"], (route, answer.text)
