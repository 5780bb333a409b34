"""The layer rules of docs/architecture.md, checked on the source: every ``import`` statement of
the package (module level or inside a function) is read with ``ast`` and held against the table.

A new import that crosses a layer fails here with the file and line; an allowed exception is a
row in ``TORCH_OUTSIDE_ENGINE`` or ``CROSSINGS`` with its reason.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import arctic_platform

PACKAGE = Path(arctic_platform.__file__).parent

# Where torch may be imported outside engine/, and why.
TORCH_OUTSIDE_ENGINE = {
    # verl hands the adapter DataProto batches of torch tensors and calls its loss on them.
    "integrations/verl/": "verl's batches and losses are torch",
    # The tensorboard tracker writes through torch's own SummaryWriter (imported when named).
    "recipes/trackers/tensorboard_tracker.py": "torch.utils.tensorboard is the writer",
}

# (importing file or folder, imported package) pairs the table's "never" column allows anyway.
CROSSINGS = {
    # The in-process and ray transports start a Service in this process / a Ray actor, lazily,
    # only when that backend is chosen.
    ("client/transports/inprocess.py", "arctic_platform.server"): "the in-process backend",
    ("client/transports/ray.py", "arctic_platform.server"): "the ray backend",
}

# Our packages above the engine-free base (wire, contract, tensor_tree).
UPPER = ("arctic_platform.client", "arctic_platform.server", "arctic_platform.engine")

# file or folder -> packages of ours it must never import
NEVER = {
    "wire.py": UPPER,
    "tensor_tree.py": UPPER,
    "contract/": UPPER,
    "client/": ("arctic_platform.server", "arctic_platform.engine"),
    "server/": ("arctic_platform.client",),
    "engine/": ("arctic_platform.client", "arctic_platform.server"),
}


def imports() -> list[tuple[str, int, str]]:
    """``(path relative to the package, line, imported name)`` for every import statement; a
    ``from`` import is recorded as ``module.name``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        module = ["arctic_platform", *Path(rel).with_suffix("").parts]
        if module[-1] == "__init__":
            module = module[:-1]
            module.append("__init__")
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                found += [(rel, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module[: -node.level]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module
                # ``from arctic_platform import wire`` imports arctic_platform.wire
                found += [(rel, node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def _under(rel: str, prefix: str) -> bool:
    return rel == prefix or (prefix.endswith("/") and rel.startswith(prefix))


def _is(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_scan_sees_imports_at_every_level():
    """The checks below are only as good as the scan: it must see module-level and in-function
    imports of torch and of our packages."""
    found = imports()
    assert ("engine/trainer.py", "torch") in {(rel, name) for rel, _, name in found}
    inprocess = [name for rel, _, name in found if rel == "client/transports/inprocess.py"]
    assert "arctic_platform.server.service.Service" in inprocess  # imported inside a method
    assert ("client/tensors.py", "arctic_platform.wire") in {(rel, n) for rel, _, n in found}


def test_torch_is_imported_only_under_engine_and_the_listed_exceptions():
    offenders = [
        f"{rel}:{line} imports {name}"
        for rel, line, name in imports()
        if _is(name, "torch")
        and not rel.startswith("engine/")
        and not any(_under(rel, allowed) for allowed in TORCH_OUTSIDE_ENGINE)
    ]
    assert offenders == []


def test_no_layer_imports_what_the_table_forbids():
    offenders = []
    for rel, line, name in imports():
        for layer, forbidden in NEVER.items():
            if not _under(rel, layer):
                continue
            for package in forbidden:
                crossing = any(_under(rel, where) and package == what for where, what in CROSSINGS)
                if _is(name, package) and not crossing:
                    offenders.append(f"{rel}:{line} imports {name}")
    assert offenders == []


def test_the_client_imports_only_wire_contract_and_its_own_modules():
    """Client modules import, of ours, only the client itself, the wire codec, the contract and
    the small shared modules below them (besides the listed lazy crossings)."""
    allowed = (
        "arctic_platform.client",
        "arctic_platform.contract",
        "arctic_platform.wire",
        "arctic_platform.tensor_tree",
        "arctic_platform._extras",
        "arctic_platform.server_identity",
    )
    offenders = []
    for rel, line, name in imports():
        if not rel.startswith("client/") or not _is(name, "arctic_platform"):
            continue
        if any(_is(name, ok) for ok in allowed):
            continue
        if any(_under(rel, where) and _is(name, what) for where, what in CROSSINGS):
            continue
        offenders.append(f"{rel}:{line} imports {name}")
    assert offenders == []


@pytest.mark.parametrize("module", ["arctic_platform.server.app", "arctic_platform.client"])
def test_importing_an_edge_loads_no_torch_even_transitively(module):
    """The scan above reads each file's own imports; this imports the server's app (every API's
    routes) and the client in a fresh interpreter and looks at everything that got loaded, so a
    chain through a torch-free-looking module is caught too. The engines load torch when a job
    builds one; the wire loads ml_dtypes (1.5-2 s to import) for the first bf16 or float8 frame."""
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'peft', 'ml_dtypes') or m == 'safetensors.torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_checking_a_train_bodys_processing_names_loads_no_torch():
    """The server checks a forward-backward body's post-processor and loss names when it is
    submitted, against the contract's registries: a good name passes and an unknown one is a 400
    naming the field, with no torch imported (the engine's code registers under those names)."""
    code = """
import sys
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.op_bodies import train_envelope
body = {"batch": {"input_ids": [[1, 2]]}, "processing": {"post": ["compute_logprobs"],
        "loss_fn": "importance_sampling"}}
train_envelope(body, op="forward-backward")
try:
    train_envelope({**body, "processing": {"loss_fn": "grpo_typo"}}, op="forward-backward")
except BadRequest as exc:
    print(exc.details["field"], exc.message)
print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    refused, loaded = out.stdout.strip().splitlines()
    assert refused.startswith("processing.loss_fn forward-backward: processing.loss_fn: unknown")
    assert "'grpo_typo'" in refused and "importance_sampling" in refused
    assert loaded == "[]"


def test_a_dssst1_forward_backward_on_a_fake_job_loads_no_torch(tmp_path):
    """The server's edge decodes DSSST1 frames to numpy, so a binary forward-backward reaches a
    FakeEngine job (bf16 field included) and answers with no torch in the server process: torch
    is the engines' business, loaded by the ones that compute in it."""
    code = """
import sys
import ml_dtypes
from pathlib import Path
import numpy as np
from starlette.testclient import TestClient
from arctic_platform import wire
from arctic_platform.layout import training_batch
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.service import Service, ServiceSettings
from tests.fake_engine import build_fake_engine

service = Service(ServiceSettings(data_dir=Path(sys.argv[1]), device="cpu"),
                  engine_builder=build_fake_engine)
app = create_app(service, auth=TokenAuth([]), close_service_on_shutdown=False)
with TestClient(app) as http:
    job = http.post("/initialize", json={"model_name": "builtin:tiny"}).json()["job_id"]
    batch = training_batch([[4, 5], [6]], [[7, 8], [9]], pad_token_id=0, advantages=[1.0, -1.0])
    batch["advantages"] = batch["advantages"].astype(ml_dtypes.bfloat16)
    frame = wire.dumps({"batch": batch, "processing": {"loss_fn": "cross_entropy"}})
    answer = http.post(f"/forward-backward?job_id={job}", content=frame,
                       headers={"content-type": "application/octet-stream"})
    print(answer.status_code, "loss" in wire.loads(answer.content))
service.close()
print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))
"""
    root = Path(arctic_platform.__file__).parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=root,
        check=True,
    )
    answered, loaded = out.stdout.strip().splitlines()[-2:]
    assert answered == "200 True", out.stdout + out.stderr[-2000:]
    assert loaded == "[]"
