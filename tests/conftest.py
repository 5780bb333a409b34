"""Test-wide settings: no model hub, deterministic threads."""

import os

# Tests never reach a model hub: built-in models are created locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
