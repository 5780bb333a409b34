"""Fixtures for server tests: a real Service on a temp dir and its FastAPI app."""

from __future__ import annotations

import httpx
import pytest

from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.service import Service, ServiceSettings
from tests.fake_engine import build_fake_engine
from tests.live_server import serve_app

TINY = "builtin:tiny"
OCTET = {"content-type": "application/octet-stream"}
CORTEX = "/api/v2/databases/DB/schemas/RL/cortex-training"


def sub_job(kind: str, **extra) -> dict:
    spec = {"job_type": kind, "model_name": TINY, "seed": 0}
    if kind == "training":
        spec["training_config"] = {"optimizer": {"name": "AdamW", "lr": 1e-3}}
    spec.update(extra)
    return spec


def job_request(*kinds: str) -> dict:
    kinds = kinds or ("training", "sampling", "log_probability")
    return {"sub_job_configs": [sub_job(k) for k in kinds]}


@pytest.fixture
def service(tmp_path):
    svc = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu"))
    yield svc
    svc.close()


@pytest.fixture
def fake_service(tmp_path):
    """A real Service whose jobs run on FakeEngine (``tests/fake_engine.py``), for tests whose
    subject is not the engine. A module whose tests are all such overrides ``service`` with it
    (``def service(fake_service): return fake_service``), so ``http`` and ``running_job`` use it
    too."""
    svc = Service(
        ServiceSettings(data_dir=tmp_path / "data", device="cpu"), engine_builder=build_fake_engine
    )
    yield svc
    svc.close()


@pytest.fixture
def running_job(service):
    """A job with training, sampling and log-prob sub-jobs, ready to use."""
    info = service.create_job(job_request())
    service.wait_until_running(info["job_id"], timeout=120)
    return info["job_id"]


def make_app(service, tokens=(), max_body_bytes=256 * 1024 * 1024, **options):
    return create_app(
        service,
        auth=TokenAuth(list(tokens)),
        max_body_bytes=max_body_bytes,
        close_service_on_shutdown=False,
        **options,
    )


@pytest.fixture
def http(service):
    """An httpx client talking to the real app over 127.0.0.1."""
    with serve_app(make_app(service)) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client
