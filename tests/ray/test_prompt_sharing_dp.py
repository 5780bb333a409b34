"""Prompt sharing on 2 DDP workers equals one engine scoring every row whole.

Its own module (and so its own job) because the Ray test cluster has 2 CPUs of bookkeeping: the
DDP and FSDP jobs of ``test_data_parallel`` hold most of them while that module runs, and a third
2-worker job would wait for CPUs that never free up.
"""

from __future__ import annotations

import numpy as np
import pytest

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.engine.prompt_sharing import SAVED_METRIC
from tests.engine.rl_batches import GROUPS, saved_prompt_tokens, shared_prompt_batch
from tests.ray.cluster import ray_backend
from tests.ray.test_data_parallel import REL, assert_close_metrics, client_config

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp(ray_cluster, tmp_path_factory):
    backend = ray_backend(tmp_path_factory.mktemp("ddp_shared"), num_training_workers=2)
    client = create_arctic_rl_client(client_config(backend), blocking_calls=True)
    yield client
    client.shutdown()


def test_two_ddp_workers_share_prompts_like_one_unshared_engine(ddp, tmp_path_factory):
    """Each prompt group stays on one worker, which computes the prompt once; the gradient
    equals one engine scoring every row whole (prompt_sharing off)."""
    batch = shared_prompt_batch(seed=3)
    reference = client_config(
        {"type": "inprocess", "data_dir": str(tmp_path_factory.mktemp("s")), "device": "cpu"},
    )
    reference["training"] = {**reference["training"], "prompt_sharing": "off"}
    request = {"batch": batch, "processing": {"loss_fn": "verl_grpo"}}
    with create_arctic_rl_client(reference, blocking_calls=True) as one:
        want = one.fwd_bwd(request)
        want_step = one.step()
        want_logprobs = one.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    got = ddp.fwd_bwd(request)
    got_step = ddp.step()
    got_logprobs = ddp.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    saved = saved_prompt_tokens(GROUPS)
    # Every group's prompt was computed once: no group was split across the workers.
    assert got["metrics"][SAVED_METRIC] == pytest.approx(saved / batch["attention_mask"].sum())
    assert want["metrics"][SAVED_METRIC] == 0.0
    del got["metrics"][SAVED_METRIC], want["metrics"][SAVED_METRIC]
    assert_close_metrics(got["metrics"], want["metrics"], "shared fwd_bwd")
    assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=REL)
    np.testing.assert_allclose(got_logprobs, want_logprobs, atol=2e-5)
