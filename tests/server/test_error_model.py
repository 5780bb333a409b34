"""One error model: a failed op reads the same on every surface (status, code, message, details),
and an exception nobody anticipated is a 500 naming the request id, its internals only in the
server's log."""

from __future__ import annotations

import logging

import pytest

from arctic_platform import wire
from arctic_platform.client.errors import NotFoundError, ServerError
from arctic_platform.contract.ops import OPS
from arctic_platform.server.async_requests import RequestStore
from tests.server.conftest import CORTEX, OCTET, job_request
from tests.waiting import wait_until

SECRET = "/srv/arctic/secret-internals"


def broken(*_args, **_kwargs):
    """A bug nobody anticipated, whose text holds what must not reach a tenant."""
    raise RuntimeError(f"unexpected state at {SECRET}")


def polled_to_the_end(http, job_id: str, request_id: str) -> dict:
    def ended() -> dict | None:
        body = http.get(f"{CORTEX}/{job_id}/requests/{request_id}").json()
        return None if body["status"] in ("pending", "running") else body

    return wait_until(ended, what=f"request {request_id}")


@pytest.fixture
def log_prob_job(service) -> str:
    return running(service, "log_probability")


def running(service, kind: str) -> str:
    job_id = service.create_job(job_request(kind))["job_id"]
    service.wait_until_running(job_id, timeout=120)
    return job_id


@pytest.mark.parametrize(
    ("kind", "op", "body", "status"),
    [
        ("log_probability", "log-probs", {"prompts": [[5] * 3000]}, 400),  # over the context
        ("log_probability", "log-probs", {"prompts": [[10**6]]}, 400),  # not in the vocabulary
        ("log_probability", "log-probs", {"prompts": ["1+2="], "top_k": 10**6}, 400),
        ("sampling", "generate", {"prompts": ["1+2="], "sampling_params": {"n": 5000}}, 413),
    ],
)
def test_a_failed_cortex_request_carries_the_onprem_error(http, service, kind, op, body, status):
    """Whether refused at submit or failed on the queue, a Cortex request's failure is the
    status, code, message and details of the on-prem answer, and the Cortex client raises the
    class the HTTP client raises for it."""
    from arctic_platform.client.errors import server_error
    from arctic_platform.client.transports.cortex import _failed_request

    job_id = running(service, kind)
    content = {"content": wire.dumps(body), "headers": OCTET}  # as the op table says it travels
    if not OPS[op].binary_request:
        content = {"json": body}
    onprem = http.post(f"/{op}?job_id={job_id}", **content)
    assert onprem.status_code == status, onprem.text
    answer = http.post(f"{CORTEX}/{job_id}/{op}", **content)
    if answer.status_code != 200:  # refused at submit
        assert (answer.status_code, answer.json()) == (status, onprem.json())
        return
    polled = polled_to_the_end(http, job_id, answer.json()["request_id"])
    assert polled["status"] == "failed"
    assert polled["error_detail"] == {"status": status, **onprem.json()}
    assert polled["error"] == onprem.json()["message"]
    raised = _failed_request(polled, op)
    expected = server_error(status, onprem.json()["code"], "", op=op)
    assert type(raised) is type(expected) and raised.code == expected.code


def test_an_unanticipated_exception_in_a_route_is_a_500_naming_the_request(
    http, service, monkeypatch, caplog
):
    monkeypatch.setattr(service, "list_jobs", broken)
    caplog.set_level(logging.ERROR, logger="arctic_platform.server")
    answer = http.get(CORTEX, headers={"x-request-id": "trace-500"})
    assert answer.status_code == 500
    assert answer.headers["x-request-id"] == "trace-500"
    assert answer.json() == {
        "message": "internal error in request trace-500; the server's log has its traceback",
        "code": "internal_error",
        "request_id": "trace-500",
    }
    assert SECRET not in answer.text and "RuntimeError" not in answer.text
    (logged,) = [r for r in caplog.records if "trace-500" in r.getMessage()]
    assert logged.exc_info is not None and SECRET in str(logged.exc_info[1])
    assert http.get("/health").status_code == 200  # the server goes on


def test_an_unanticipated_exception_in_a_cortex_request_is_a_500_naming_it(
    http, service, log_prob_job, monkeypatch, caplog
):
    monkeypatch.setattr(RequestStore, "_outcome", staticmethod(broken))
    caplog.set_level(logging.ERROR, logger="arctic_platform.server")
    body = {"prompts": ["1+2="]}
    request_id = http.post(f"{CORTEX}/{log_prob_job}/log-probs", json=body).json()["request_id"]
    polled = polled_to_the_end(http, log_prob_job, request_id)
    message = f"internal error in request {request_id}; the server's log has its traceback"
    assert polled["status"] == "failed" and polled["error"] == message
    assert polled["error_detail"] == {
        "status": 500,
        "message": message,
        "code": "internal_error",
        "request_id": request_id,
    }
    assert SECRET not in str(polled) and "RuntimeError" not in str(polled)
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    assert service.get_job(log_prob_job)["status"] == "running"


def test_a_missing_request_is_the_same_not_found_for_the_cortex_client(http, log_prob_job):
    from arctic_platform.client.transports.cortex import _failed_request

    answer = http.get(f"{CORTEX}/{log_prob_job}/requests/nope")
    assert answer.status_code == 404
    detail = {"status": 404, **answer.json()}
    assert isinstance(_failed_request({"error_detail": detail}, "op"), NotFoundError)
    # A server that sends only the reference's string gets the plain error.
    plain = _failed_request({"error": "boom"}, "op")
    assert type(plain) is ServerError and str(plain).startswith("op: boom")


async def test_an_unanticipated_exception_in_a_tinker_op_names_its_request(caplog):
    import json
    from concurrent.futures import Future

    from arctic_platform.server.tinker.futures import FutureStore

    caplog.set_level(logging.ERROR, logger="arctic_platform.server")
    store, failed = FutureStore(), Future()
    failed.set_exception(RuntimeError(f"unexpected state at {SECRET}"))
    request_id = store.add("alice", failed)
    answer = await store.retrieve(request_id, "alice")
    assert answer.status_code == 200
    assert json.loads(answer.body) == {
        "error": f"internal error in request {request_id}; the server's log has its traceback",
        "category": "server",
    }
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)


def test_an_unanticipated_exception_on_the_ray_backend_is_the_same_500(caplog):
    """The server-state actor's reply, as the Ray client transport raises it (the actor and the
    transport are plain classes; Ray only carries the tuple between them)."""
    from arctic_platform.client.transports.ray import RayTransport
    from arctic_platform.server.ray_state import ServerState

    caplog.set_level(logging.ERROR, logger="arctic_platform.server")
    reply = ServerState._reply(broken)
    kind, body = reply
    request_id = body["details"]["request_id"]
    message = f"internal error in request {request_id}; the server's log has its traceback"
    assert kind == "error" and body["status"] == 500 and body["code"] == "internal_error"
    assert body["message"] == message
    assert SECRET not in str(reply) and "RuntimeError" not in str(reply)
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    with pytest.raises(ServerError) as raised:
        RayTransport._unwrap(reply, "generate")
    assert raised.value.code == "internal_error" and message in str(raised.value)


@pytest.mark.parametrize("route", ["/generate?job_id={job}", CORTEX + "/{job}/generate"])
def test_a_bad_sampling_parameter_is_a_400_at_submit_naming_it(http, service, route):
    """Checked by the body's contract model: nothing is queued (on Cortex, no request id)."""
    job_id = running(service, "sampling")
    body = {"prompts": ["1+2="], "sampling_params": [{"top_p": 2.0}]}
    answer = http.post(route.format(job=job_id), content=wire.dumps(body), headers=OCTET)
    assert answer.status_code == 400, answer.text
    assert answer.json()["message"].startswith(
        "generate: sampling_params[0].top_p must be in (0, 1]"
    )
    assert "request_id" not in answer.json()


@pytest.mark.parametrize(
    "route",
    ["/generate?job_id={job}", CORTEX + "/{job}/generate", CORTEX + "/{job}/generate-stream"],
)
def test_a_float_n_counts_toward_the_sample_limit(http, service, route):
    """``n: 5000.0``, which the engines take for 5000, counted as one sample: it passed
    ``--max-samples-per-request`` on every data-plane route (the OpenAI API parsed it)."""
    job_id = running(service, "sampling")
    body = {"prompts": ["1+2="], "sampling_params": {"n": 5000.0, "max_tokens": 1}}
    if route.endswith("generate-stream"):  # a JSON body
        answer = http.post(route.format(job=job_id), json=body)
    else:
        answer = http.post(route.format(job=job_id), content=wire.dumps(body), headers=OCTET)
    assert answer.status_code == 413, answer.text
    assert answer.json()["limit"] == "max_samples_per_request"


@pytest.mark.parametrize(
    ("params", "status", "count"),
    [({"n": None}, 200, 2), ([{"n": 2}], 400, None), ({"n": 3, "max_tokens": 1}, 200, 6)],
)
def test_generate_stream_counts_the_validated_samples(http, service, params, status, count):
    """The stream's ``count`` comes from the validated body (``n: null`` was a 500), and
    sampling params of another length than the prompts are a 400 at submit (they failed the
    request once it ran)."""
    job_id = running(service, "sampling")
    body = {"prompts": ["1+2=", "3+4="], "sampling_params": params}
    answer = http.post(f"{CORTEX}/{job_id}/generate-stream", json=body)
    assert answer.status_code == status, answer.text
    if status == 200:
        assert answer.json()["count"] == count
    else:
        assert answer.json()["message"] == (
            "generate-stream: sampling_params has 1 entries for 2 prompts (one each)"
        )
