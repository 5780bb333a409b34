"""tinker-cookbook's own RL loop (``tinker_cookbook.rl.train.main``) against our server.

Nothing of the cookbook is patched: the loop gets our ``base_url`` and a local model folder as
``model_name``, and drives the Tinker API end to end (warm-up state load, sampling clients per
step, ``forward_backward`` + ``optim_step``, final checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="the tinker SDK (Python >= 3.11) is not installed")
pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (see .ci/run)")

from arctic_platform.engine.builtin import builtin_model_path
from arctic_platform.recipes import tinker_addition
from arctic_platform.server.app import create_app
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app

pytestmark = pytest.mark.slow


def test_cookbook_rl_loop_runs_on_our_server(tmp_path):
    import tinker

    # the cookbook names the model by its local folder, which the operator allows (--allow-path)
    models = Path(builtin_model_path("builtin:tiny")).parent
    service = Service(
        ServiceSettings(data_dir=tmp_path / "data", device="cpu", allowed_paths=(models,))
    )
    log_path = tmp_path / "log"
    with serve_app(create_app(service)) as url:
        rewards = tinker_addition.run(url, str(log_path), warmup_steps=2, rl_steps=3)
        rest = tinker.RestClient(base_url=url, api_key="tml-local")
        saved = [
            json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()
        ]
        final = saved[-1]
        run_id = final["state_path"].split("/")[2]
        listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert len(rewards) == 3  # one cookbook metrics row per RL step, rewards in the task's range
    assert all(-0.1 <= r <= 1.0 for r in rewards)
    assert {final["state_path"], final["sampler_path"]} <= listed
    assert Path(log_path / "metrics.jsonl").is_file()


def test_rl_samples_have_room_for_the_longest_answer_and_the_stop_sequence():
    """The cookbook rewards the format only when a sample ends in the renderer's stop sequence;
    with fewer tokens than answer + stop sequence no sample could ever be rewarded."""
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    model = builtin_model_path("builtin:tiny")
    tokenizer = get_tokenizer(model)
    renderer = tinker_addition.renderers.get_renderer(tinker_addition.RENDERER, tokenizer)
    (stop,) = renderer.get_stop_sequences()
    needed = len(tokenizer.encode(" 18" + stop, add_special_tokens=False))
    assert tinker_addition.response_budget(model, max_operand=9) == needed
