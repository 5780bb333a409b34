"""``config/remote_backend/arctic.yaml``: every key documented and in step with the code."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest
import yaml

from arctic_platform.client.config import CortexBackend, HttpBackend, InProcessBackend, RayBackend

YAML = files("arctic_platform.integrations.verl.config").joinpath("remote_backend/arctic.yaml")
KEY_LINE = re.compile(r"^\s*([A-Za-z_][\w]*):")


def test_every_key_has_a_comment_above_it():
    lines = YAML.read_text().splitlines()
    for number, line in enumerate(lines):
        match = KEY_LINE.match(line)
        if not match:
            continue
        previous = next(p for p in reversed(lines[:number]) if p.strip())
        assert previous.strip().startswith("#"), f"line {number + 1}: {match[1]} has no comment"


def test_the_yaml_defaults_are_the_codes_defaults(remote_backend):
    from arctic_platform.integrations.verl.verl_config import ArcticSettings

    data = yaml.safe_load(YAML.read_text())
    assert data["name"] == "arctic"
    settings = ArcticSettings.model_validate(data["arctic"])  # no unknown key
    sections = {"inprocess", "http", "ray", "cortex"}
    assert settings.model_dump(exclude=sections) == ArcticSettings().model_dump(exclude=sections)


@pytest.mark.parametrize(
    ("section", "model"),
    [
        ("inprocess", InProcessBackend),
        ("http", HttpBackend),
        ("ray", RayBackend),
        ("cortex", CortexBackend),
    ],
)
def test_backend_sections_use_the_clients_keys(section, model):
    keys = set(yaml.safe_load(YAML.read_text())["arctic"][section])
    assert keys <= model.known_keys(), keys - model.known_keys()
