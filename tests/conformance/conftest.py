"""The conformance suite's one real-engine run, shared by its modules."""

from __future__ import annotations

import pytest

from arctic_platform.client import create_arctic_rl_client
from tests.client.conftest import backend_config
from tests.conformance.script import protocols_met, run_script
from tests.conformance.surfaces import client_config


@pytest.fixture(scope="session")
def torch_answers(tmp_path_factory) -> dict:
    """The script's answers in-process on the real engine (the built-in tiny model), and
    whether each engine met its Protocol (``"protocols"``)."""
    data_dir = tmp_path_factory.mktemp("torch")
    config = client_config(backend_config("inprocess", None, data_dir))
    with create_arctic_rl_client(config, blocking_calls=True) as client:
        met = protocols_met(client.get_server_state(), client)
        return {**run_script(client), "protocols": met}
