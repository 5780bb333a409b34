"""The op table is what the routers, the Service and the client actually serve and send."""

from __future__ import annotations

import pytest

from arctic_platform.client import OPS
from arctic_platform.contract import ops as contract
from arctic_platform.server.cortex import PREFIX

REFERENCE_CLIENT_OPS = {
    "forward-backward",
    "forward",
    "step",
    "save",
    "load-checkpoint",
    "generate",
    "log-probs",
    "operation",
    "sleep-inference",
    "wake-inference",
    "sleep-training",
    "wake-training",
}


def test_the_client_sends_the_reference_op_names_and_no_others():
    assert REFERENCE_CLIENT_OPS <= OPS
    assert {"empty-training-cache", "tokenize"} == OPS - REFERENCE_CLIENT_OPS


def test_every_op_that_runs_on_a_sub_job_has_a_runner():
    """An op of the table is served once ``server/ops.py`` registers its runner (``@_runs``);
    one without a runner would reach the Service and fail there."""
    from arctic_platform.server.ops import _HANDLERS

    on_sub_jobs = {op.name for op in contract.OPS.values() if op.job_types}
    assert set(_HANDLERS) == on_sub_jobs


def test_every_route_of_the_table_is_served_and_no_other(tmp_path):
    """Each op's on-prem and Cortex route reaches the Service (which then looks for the job)."""
    import httpx

    from arctic_platform.server.app import create_app
    from arctic_platform.server.auth import TokenAuth
    from arctic_platform.server.service import Service, ServiceSettings
    from tests.live_server import serve_app

    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    app = create_app(service, auth=TokenAuth([]), close_service_on_shutdown=False)
    cortex = PREFIX.format(database="DB", schema="RL", endpoint="cortex-training")
    try:
        with serve_app(app) as url, httpx.Client(base_url=url) as http:

            def reaches_service(path: str) -> bool:
                """A route of ours answered (a 404 for the job, a 400 for the body), not the
                router's "no such route"."""
                reply = http.post(path, json={})
                routed = reply.status_code in (400, 404) and "unknown op" not in reply.text
                return routed and reply.json() != {"detail": "Not Found"}

            for name in contract.OPS:
                assert reaches_service(f"/{name}?job_id=nojob") == (name in contract.ONPREM_OPS)
            routes = {op.cortex_route for op in contract.OPS.values() if op.cortex_route}
            for route in routes | {"operation"}:
                assert reaches_service(f"{cortex}/nojob/{route}"), route
            assert not reaches_service(f"{cortex}/nojob/fwd-bwd")
    finally:
        service.close()


@pytest.mark.parametrize(
    ("name", "reference", "role"),
    [
        ("forward", False, "training"),
        ("forward", True, "log_prob"),
        ("sleep-inference", False, "sampling"),
        ("log-probs", False, "log_prob"),
        ("weight-sync", False, "training"),
    ],
)
def test_an_op_addressed_to_a_parent_job_runs_on_its_default_sub_job(name, reference, role):
    assert contract.default_role(name, reference_model=reference) == role


def test_only_ops_that_may_be_repeated_are_retried_after_sending():
    never = {op.name for op in contract.OPS.values() if op.retry == "never" and op.cortex_route}
    assert never == {"step", "save", "load-checkpoint"}
    assert contract.op("forward-backward").retry == "chunk_group"


def test_an_unknown_op_is_an_error_naming_the_known_ones():
    with pytest.raises(KeyError, match="known: .*forward-backward"):
        contract.op("fwd-bwd")


def test_the_client_imports_only_the_wire_codec_and_the_contract():
    """Layering: importing the client loads nothing of the server or the engines (nor torch)."""
    import subprocess
    import sys

    code = (
        "import sys, arctic_platform.client, arctic_platform.rl; "
        "print(sorted(m for m in sys.modules if m.startswith(('arctic_platform.server', "
        "'arctic_platform.engine', 'torch', 'fastapi'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# Where a string spelled like an op name means something else, and why (issue 23: no op-name
# literal lives anywhere but contract/ops.py; everything else names an op as ``OpName.X``).
NOT_OP_NAMES = {
    # The Python method named in a client-side argument error (``step: learning_rate ...``,
    # ``generate: prompts ...``), and the ``step`` field of a save/load body.
    ("arctic_platform/client/calls.py", "step"),
    ("arctic_platform/client/calls.py", "generate"),
    # The ``step`` field a Cortex load looks the checkpoint up by.
    ("arctic_platform/client/transports/cortex.py", "step"),
    # A checkpoint's training step (a field name, a metric key), not the optimizer-step op.
    ("arctic_platform/engine/checkpoint_layout.py", "step"),
    ("arctic_platform/engine/trainer.py", "step"),
    # vLLM's own method name, and the vLLM worker's op of that name (its channel's protocol: the
    # script runs in vLLM's interpreter, which cannot import this package).
    ("arctic_platform/engine/vllm_backend/engine.py", "generate"),
    ("arctic_platform/engine/vllm_backend/worker.py", "generate"),
    # The recipes' step counter in run logs, records and trackers.
    ("arctic_platform/recipes/grpo.py", "step"),
    ("arctic_platform/recipes/run_log.py", "step"),
    ("arctic_platform/recipes/trackers/__init__.py", "step"),
    # Training-engine methods the Ray proxy relays to its ranks (``forward``, ``step``), by name.
    ("arctic_platform/server/ray_engines.py", "forward"),
    ("arctic_platform/server/ray_engines.py", "step"),
}


def op_name_literals(source: str, rel: str) -> set[tuple[str, str]]:
    """``(rel, name)`` for every string constant of ``source`` that spells an op name."""
    import ast

    return {
        (rel, node.value)
        for node in ast.walk(ast.parse(source, rel))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if node.value in contract.OPS
    }


def test_op_names_are_written_only_in_the_op_table():
    """Code outside contract/ops.py names an op as ``OpName.X``: a literal ``"forward-backward"``
    in the server or the client fails here (a string that only looks like an op name is a row of
    ``NOT_OP_NAMES`` with its reason)."""
    from pathlib import Path

    import arctic_platform

    root = Path(arctic_platform.__file__).parent.parent
    found: set[tuple[str, str]] = set()
    for path in sorted((root / "arctic_platform").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel != "arctic_platform/contract/ops.py":
            found |= op_name_literals(path.read_text(), rel)
    assert sorted(found - NOT_OP_NAMES) == [], "write contract.ops.OpName.X instead"
    assert sorted(NOT_OP_NAMES - found) == [], "a NOT_OP_NAMES row no longer applies: remove it"


def test_the_scan_finds_an_op_name_written_as_a_string():
    rel = "arctic_platform/server/example.py"
    source = 'x = {"forward-backward": 1}\ny = f"{x}"\nz = "forward_backward"\n'
    assert op_name_literals(source, rel) == {(rel, "forward-backward")}


def test_op_names_are_the_table_and_read_as_plain_strings():
    """An ``OpName`` member is the plain name everywhere it ends up: as a key, in a message (also
    with ``!r``), in JSON. Each name is in exactly one table: the ops on sub-jobs or the job ops."""
    import json

    from arctic_platform.contract.job_ops import JOB_OPS

    assert set(contract.OpName) == set(contract.OPS) | set(JOB_OPS)
    assert not set(contract.OPS) & set(JOB_OPS)
    assert all(type(op.name) is contract.OpName for op in contract.OPS.values())
    name = contract.OpName.FORWARD_BACKWARD
    assert contract.OPS["forward-backward"] is contract.OPS[name]
    assert {"forward-backward": 1}[name] == 1
    assert f"{name}: {name!r}" == "forward-backward: 'forward-backward'"
    assert str(name) == "forward-backward" and type(str(name)) is str
    assert json.dumps({name: name}) == '{"forward-backward": "forward-backward"}'
    assert str(sorted(contract.OPS)).startswith("['cancel-request', ")
