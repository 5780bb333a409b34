"""A tenant's unfinished ops are bounded in bytes, on every surface that queues them.

An op holds its body from acceptance to its end: queued behind others, or (Tinker) parked until
its ``seq_id``'s turn. Without a bound, a tenant submitting 50 MB bodies faster than they ran
held 3.8 GB after 40 of them, and nothing refused it. With ``--max-pending-mb-per-tenant`` one
more op is refused at once with 429 ``limit_exceeded`` (413 for one op beyond the bound alone),
before it is queued: it never runs, another tenant is not held back, and the tenant's next op is
accepted once earlier ones have finished. The server runs at 1 MiB here, so that three bodies of
about 300 KB fill it.
"""

from __future__ import annotations

import json
import sys
import threading
import tracemalloc
from contextlib import closing, contextmanager

import httpx
import numpy as np
import pytest

from arctic_platform import wire
from arctic_platform.server.errors import PayloadTooLarge, TooManyRequests
from arctic_platform.server.limits import MIB, ServerLimits
from arctic_platform.server.pending_work import OP_OVERHEAD_BYTES, payload_nbytes
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.tinker import proto
from tests.fake_engine import build_fake_engine
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, job_request, make_app
from tests.server.test_hostile_uploads import ALICE, BOB, credentials
from tests.server.tinker.conftest import TINY
from tests.server.tinker.plain_http import PROTOBUF, TinkerHttp
from tests.waiting import wait_until

LIMITS = ServerLimits(max_pending_mb_per_tenant=1)


def test_payload_nbytes_counts_arrays_by_their_buffers():
    torch = pytest.importorskip("torch")
    ids = np.zeros((4, 8), np.int64)
    assert payload_nbytes(ids) == ids.nbytes
    assert payload_nbytes(torch.zeros(3, 5)) == 60
    assert payload_nbytes(memoryview(ids)) == ids.nbytes  # its bytes, not its length
    body = {"batch": {"ids": ids}}
    assert payload_nbytes(body) == ids.nbytes + payload_nbytes({"batch": {"ids": None}}) - 16
    nested: list = []
    for _ in range(100_000):  # deeper than the interpreter's recursion limit
        nested = [nested]
    assert payload_nbytes(nested) == 100_000 * sys.getsizeof([[]]) + sys.getsizeof([])


# Parsed JSON bodies of every shape a tenant can send: what json.loads builds from each is
# measured by tracemalloc, independently of the count.
PARSED_SHAPES = {
    "empty containers": "[" + ",".join(["[]", "{}"] * 50_000) + "]",
    "free-form meta": json.dumps({"meta": {"notes": [{"a": [[], "b"]} for _ in range(20_000)]}}),
    "token ids": json.dumps(
        {"prompts": [list(range(10**5 + i, 10**5 + i + 300)) for i in range(300)]}
    ),
    "large ints": "[" + ",".join(str(7**k) for k in range(2_000)) + "]",
    "floats": json.dumps({"advantages": [[0.5 + i / 7] * 200 for i in range(500)]}),
    "strings": json.dumps({"texts": ["x" * i for i in range(2_000)]}),
    "mixed": json.dumps([[1, None, 2.5, True, "s"]] * 20_000),
}


@pytest.mark.parametrize("shape", PARSED_SHAPES)
def test_payload_nbytes_counts_what_a_parsed_json_body_holds(shape):
    """The count follows the objects, not the text: a body of empty containers (3 bytes of JSON
    each, 56 or 64 in memory) counted as nothing would let a tenant queue gigabytes. Never below
    what the body holds; above it where json.loads shares objects (a dict's repeated keys,
    small ints, None), which the count takes one by one."""
    text = PARSED_SHAPES[shape]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        parsed = json.loads(text)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.98 * held <= payload_nbytes(parsed) <= 2 * held


def test_small_token_ids_are_counted_at_most_at_a_number_each():
    """Ints below 2**30 are counted at the size of such an int without measuring each one
    (small ones are shared objects, so the count is then above what they hold, never below)."""
    ids = [5] * 1000
    assert payload_nbytes(ids) == sys.getsizeof(ids) + 1000 * sys.getsizeof(2**29)
    assert payload_nbytes([2**40, None]) == sys.getsizeof([0, 0]) + sys.getsizeof(2**40) + 16


def _forward_backward_frame(rows: int) -> bytes:
    """A DSSST1 forward-backward body of ``rows`` x 256 tokens (16 bytes a token)."""
    batch = {
        "input_ids": np.full((rows, 256), 5, np.int64),
        "attention_mask": np.ones((rows, 256), np.int64),
    }
    return wire.dumps({"batch": batch})


def _ops_run(service: Service) -> float:
    value = service.metrics.registry.get_sample_value(
        "arctic_ops_total", {"op": "forward-backward", "status": "ok"}
    )
    return value or 0.0


def test_a_tenants_unfinished_ops_are_bounded_on_cortex_and_in_process(tmp_path):
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=LIMITS)
    service = Service(settings, engine_builder=build_fake_engine)
    app = make_app(service, tokens=[ALICE, BOB])
    alice, bob = (app.state.auth.owner(f"Bearer {token}") for token in (ALICE, BOB))
    gate = threading.Event()
    frame = _forward_backward_frame(72)  # about 300 KB
    try:
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:

            def submit(job: str, token: str, body: bytes = frame) -> httpx.Response:
                headers = {**OCTET, **credentials(token)}
                return http.post(f"{CORTEX}/{job}/forward-backward", content=body, headers=headers)

            jobs = {}
            for owner, token in ((alice, ALICE), (bob, BOB)):
                jobs[token] = service.create_job(job_request("training"), owner=owner)["job_id"]
                service.wait_until_running(jobs[token], owner=owner, timeout=60)
            sub = service.resolve(jobs[ALICE], owner=alice, kind="training")
            # The test's own op at the head of Alice's queue keeps hers waiting behind it.
            service.executor.submit_runner(sub, "step", lambda: gate.wait(60))

            accepted = [submit(jobs[ALICE], ALICE) for _ in range(3)]
            assert [a.status_code for a in accepted] == [200] * 3, accepted[-1].text
            each = service.pending.held(alice) // 3
            assert each > OP_OVERHEAD_BYTES + 290_000
            refused = submit(jobs[ALICE], ALICE)
            assert refused.status_code == 429, refused.text
            body = refused.json()
            assert body["code"] == "limit_exceeded"
            assert body["limit"] == "max_pending_mb_per_tenant" and body["maximum"] == MIB
            assert "--max-pending-mb-per-tenant" in body["message"]
            assert service.pending.held(alice) == 3 * each  # the refused op holds nothing
            # The same frame in a Cortex chunk group: refused when it completes, its chunks kept.
            chunks = wire.encode_byte_chunks(
                frame, kind="request", operation="forward-backward", max_bytes=100_000
            )
            posted = [submit(jobs[ALICE], ALICE, chunk) for chunk in chunks]
            assert [p.status_code for p in posted[:-1]] == [200] * (len(chunks) - 1)
            assert posted[-1].status_code == 429, posted[-1].text

            # In process, through the Service, the same bound on the same tenant.
            with pytest.raises(TooManyRequests, match="max-pending-mb-per-tenant"):
                service.submit(sub, "forward-backward", wire.loads(frame))
            # Another tenant is not held back; one op beyond the bound alone never fits: 413.
            assert submit(jobs[BOB], BOB).status_code == 200
            too_large = submit(jobs[BOB], BOB, _forward_backward_frame(300))
            assert too_large.status_code == 413, too_large.text
            assert too_large.json()["limit"] == "max_pending_mb_per_tenant"
            bobs_sub = service.resolve(jobs[BOB], owner=bob, kind="training")
            with pytest.raises(PayloadTooLarge):
                service.submit(bobs_sub, "forward-backward", wire.loads(frame) | {"x": frame * 4})

            gate.set()
            wait_until(lambda: service.pending.held(alice) == 0, what="Alice's ops finished")
            wait_until(lambda: service.pending.held(bob) == 0, what="Bob's op finished")
            # Only the accepted ops ran: three of Alice's and one of Bob's.
            wait_until(lambda: _ops_run(service) == 4, what="the accepted ops counted")
            assert submit(jobs[ALICE], ALICE).status_code == 200
            # The client's retry of the group's last chunk submits the frame it kept.
            retried = submit(jobs[ALICE], ALICE, chunks[-1])
            assert retried.status_code == 200 and retried.json()["request_id"], retried.text
            wait_until(lambda: service.pending.held(alice) == 0, what="Alice's next ops finished")
            wait_until(lambda: _ops_run(service) == 6, what="the two counted")
    finally:
        gate.set()
        service.close()


def test_a_body_is_counted_by_what_it_holds_not_by_its_text(tmp_path):
    """A training op's ``meta`` is free-form (verl's ``meta_info``): a tenant can fill it with
    empty lists, 3 bytes of frame header each and 64 in memory once parsed. Counted by its
    text, or with containers as nothing, a 150 KB body holding 1.4 MB would be queued; it is
    refused before it runs, on Cortex and in process alike."""
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=LIMITS)
    service = Service(settings, engine_builder=build_fake_engine)
    app = make_app(service, tokens=[ALICE])
    alice = app.state.auth.owner(f"Bearer {ALICE}")
    batch = {"input_ids": np.full((2, 8), 5, np.int64), "attention_mask": np.ones((2, 8), np.int64)}
    frame = wire.dumps({"batch": batch, "meta": {"notes": [[] for _ in range(22_000)]}})
    assert len(frame) < 150_000
    try:
        job = service.create_job(job_request("training"), owner=alice)["job_id"]
        service.wait_until_running(job, owner=alice, timeout=60)
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            headers = {**OCTET, **credentials(ALICE)}
            refused = http.post(f"{CORTEX}/{job}/forward-backward", content=frame, headers=headers)
        assert refused.status_code == 413, refused.text
        assert refused.json()["limit"] == "max_pending_mb_per_tenant"
        sub = service.resolve(job, owner=alice, kind="training")
        with pytest.raises(PayloadTooLarge, match="max-pending-mb-per-tenant"):
            service.submit(sub, "forward-backward", wire.loads(frame))
        assert service.pending.held(alice) == 0 and _ops_run(service) == 0
    finally:
        service.close()


def _tinker_forward(model_id: str, seq_id: int, datums: int) -> bytes:
    """A Tinker forward (cross-entropy) of ``datums`` datums of 1,000 tokens (16 KB each)."""
    message = proto.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=True
    )
    tokens = np.full(1000, 5, np.int64)
    for _ in range(datums):
        item = message.data.add()
        item.model_input.add().encoded_text.tokens = tokens.astype(np.int32).tobytes()
        item.loss_fn_inputs["target_tokens"].CopyFrom(
            proto.Tensor(dense=tokens.tobytes(), dtype=proto.DTYPE_INT64, shape=[1000])
        )
        weights = np.ones(1000, np.float32)
        item.loss_fn_inputs["weights"].CopyFrom(
            proto.Tensor(dense=weights.tobytes(), dtype=proto.DTYPE_FLOAT32, shape=[1000])
        )
    return message.SerializeToString()


@contextmanager
def _tinker_training(tmp_path):
    """A server bounded by ``LIMITS`` with Alice's Tinker session and training run on it:
    ``(service, app, tinker, session, model_id)``."""
    service = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=LIMITS))
    app = make_app(service, tokens=[ALICE])
    try:
        with serve_app(app) as url, closing(TinkerHttp(url, ALICE)) as tinker:
            session = tinker.session()
            yield service, app, tinker, session, tinker.training_run(session, TINY)
    finally:
        service.close()


def test_tinker_requests_parked_for_their_turn_are_bounded(tmp_path):
    """Requests numbered past a ``seq_id`` that never comes wait for it, each holding its body:
    the fourth of about 300 KB is refused, and keeps its ``seq_id`` for the SDK's retry, which
    is accepted once the missing requests came and the parked ones ran. A request still parked
    when its run's job ends, or its session finishes, ends then."""
    with _tinker_training(tmp_path) as (service, app, tinker, session, model_id):
        alice = app.state.auth.owner(f"Bearer {ALICE}")

        def forward(seq_id: int, datums: int = 8, model: str = model_id) -> httpx.Response:
            return tinker.http.post(
                "/forward_backward",
                content=_tinker_forward(model, seq_id, datums),
                headers={"content-type": PROTOBUF},
            )

        parked = [forward(seq_id) for seq_id in (3, 4, 5)]  # 1 and 2 not sent yet
        assert [p.status_code for p in parked] == [200] * 3, parked[-1].text
        refused = forward(6)
        assert refused.status_code == 429, refused.text
        assert refused.json()["limit"] == "max_pending_mb_per_tenant"
        held = service.pending.held(alice)
        assert held > 3 * 200_000
        assert forward(6).status_code == 429 and service.pending.held(alice) == held

        first = [forward(seq_id, datums=1) for seq_id in (1, 2)]
        for answer in [*first, *parked]:
            assert answer.status_code == 200, answer.text
            tinker.result(answer.json()["request_id"]).raise_for_status()
        wait_until(lambda: service.pending.held(alice) == 0, what="the parked requests ran")
        retried = forward(6)  # its seq_id was not used up by the refusal
        assert retried.status_code == 200, retried.text
        tinker.result(retried.json()["request_id"]).raise_for_status()

        # A request beyond the bound alone is refused for good, and its seq_id is used up:
        # the next one runs instead of parking behind it.
        assert forward(7, datums=70).status_code == 413
        after = forward(8, datums=1)
        assert after.status_code == 200, after.text
        tinker.result(after.json()["request_id"]).raise_for_status()

        # A request parked in a run whose job ends on its own (here: cancelled) ends at the
        # session reaper's next sweep, freeing its bytes.
        other = tinker.training_run(session, TINY, seq=1)
        stranded = forward(2, model=other)  # 1 never comes
        assert stranded.status_code == 200, stranded.text
        assert service.pending.held(alice) > 200_000
        service.cancel_job(app.state.tinker.state.run(other, alice).job_id, owner=alice)
        app.state.tinker.reaper.reap()
        assert service.pending.held(alice) == 0
        assert "cancelled" in tinker.result(stranded.json()["request_id"]).text

        # A request parked when its session finishes ends with its job, freeing its bytes.
        orphan = forward(10)  # 9 never comes
        assert orphan.status_code == 200, orphan.text
        assert service.pending.held(alice) > 200_000
        finished = tinker.http.post(f"/sessions/{session}/finish", json={})
        assert finished.status_code == 204, finished.text
        assert service.pending.held(alice) == 0
        ended = tinker.result(orphan.json()["request_id"])
        assert "cancelled" in ended.text, ended.text


def _ragged_forward(model_id: str, seq_id: int, long: int, short: int) -> bytes:
    """A Tinker forward of one datum of ``long`` tokens and ``short`` datums of one token: a few
    KB of protobuf that pad to a ``[short + 1, long + 1]`` batch."""
    message = proto.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=True
    )
    for length in [long] + [1] * short:
        item = message.data.add()
        tokens = np.full(length, 5, np.int64)
        item.model_input.add().encoded_text.tokens = tokens.astype(np.int32).tobytes()
        for name, values, dtype in (
            ("target_tokens", tokens, proto.DTYPE_INT64),
            ("weights", np.ones(length, np.float32), proto.DTYPE_FLOAT32),
        ):
            item.loss_fn_inputs[name].CopyFrom(
                proto.Tensor(dense=values.tobytes(), dtype=dtype, shape=[length])
            )
    return message.SerializeToString()


def test_a_parked_tinker_request_counts_the_batch_it_built(tmp_path):
    """A forward_backward is decoded and padded into its batch when it is accepted, and holds
    that batch while it waits for its turn: 15 KB of protobuf holding 300 KB of batch counts as
    300 KB (counted by their protobuf, ten parked requests of 300 KB padding to [4001, 1001]
    counted 3 MB and held 1.5 GB). The fourth is refused with 429 and keeps its ``seq_id``;
    one whose batch alone exceeds the bound is a 413 and uses its ``seq_id`` up."""
    with _tinker_training(tmp_path) as (service, app, tinker, _session, model_id):
        alice = app.state.auth.owner(f"Bearer {ALICE}")

        def forward(seq_id: int, long: int = 50, short: int = 150) -> httpx.Response:
            body = _ragged_forward(model_id, seq_id, long, short)
            headers = {"content-type": PROTOBUF}
            return tinker.http.post("/forward_backward", content=body, headers=headers)

        assert len(_ragged_forward(model_id, 2, 50, 150)) < 16_000

        parked = [forward(seq_id) for seq_id in (2, 3, 4)]  # 1 not sent yet
        assert [p.status_code for p in parked] == [200] * 3, parked[-1].text
        assert service.pending.held(alice) > 3 * 250_000
        refused = forward(5)
        assert refused.status_code == 429, refused.text
        assert refused.json()["limit"] == "max_pending_mb_per_tenant"

        too_large = forward(6, long=400, short=800)  # a [801, 401] batch
        assert too_large.status_code == 413, too_large.text
        reused = forward(6)  # its seq_id was used up by the refusal
        assert reused.status_code == 400 and reused.json()["field"] == "seq_id", reused.text

        first = forward(1, short=1)
        for answer in [first, *parked]:
            assert answer.status_code == 200, answer.text
            tinker.result(answer.json()["request_id"]).raise_for_status()
        wait_until(lambda: service.pending.held(alice) == 0, what="the parked requests ran")
        retried = forward(5)  # kept its seq_id
        assert retried.status_code == 200, retried.text
        tinker.result(retried.json()["request_id"]).raise_for_status()
        assert forward(7).status_code == 200  # 6 was used up, so 7 runs at once


def test_the_sdk_is_told_to_send_forward_backward_chunks_in_order(tmp_path):
    """Sent first-chunk-last (the SDK's default), a large forward_backward's later chunks would
    park waiting for the first and, once they filled the bound, never let the SDK send it."""
    types = pytest.importorskip("tinker.types")
    service = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu"))
    try:
        with serve_app(make_app(service, tokens=[ALICE])) as url, httpx.Client() as http:
            answer = http.post(f"{url}/api/v1/client/config", json={}, headers=credentials(ALICE))
        config = types.ClientConfigResponse.model_validate(answer.json())
        assert config.parallel_fwdbwd_chunks is False
    finally:
        service.close()


def test_an_openai_completion_beyond_the_bound_alone_is_refused_before_it_runs(tmp_path):
    """The OpenAI API submits through the same ``Service.submit``: a completion whose token-id
    prompt holds more than the tenant's bound is a 413 in OpenAI's shape, naming the limit, and
    never reaches the engine (nor its prompt-length check); a small one is then answered."""
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=LIMITS)
    service = Service(settings)
    app = make_app(service, tokens=[ALICE])
    huge = {"model": TINY, "prompt": [5] * (MIB // 8), "max_tokens": 2}
    try:
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=120) as http:
            headers = credentials(ALICE)
            refused = http.post("/v1/completions", json=huge, headers=headers)
            assert refused.status_code == 413, refused.text
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "limit_exceeded"
            assert error["param"] == "max_pending_mb_per_tenant"
            assert "--max-pending-mb-per-tenant" in error["message"]
            ran = service.metrics.registry.get_sample_value(
                "arctic_ops_total", {"op": "generate", "status": "ok"}
            )
            assert ran is None
            small = {"model": TINY, "prompt": "1+2=", "max_tokens": 2, "seed": 3}
            answered = http.post("/v1/completions", json=small, headers=headers)
            assert answered.status_code == 200, answered.text
            assert answered.json()["usage"]["completion_tokens"] == 2
            assert service.pending.held(app.state.auth.owner(f"Bearer {ALICE}")) == 0
    finally:
        service.close()
