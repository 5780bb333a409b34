"""Two data-parallel Ray training workers equal one engine on the whole batch.

The same requests go to an ``inprocess`` client (one engine, the reference) and to ``ray``
clients with 2 workers (DDP; FSDP2 colocated with a sampler): gradient accumulation over calls,
global normalisation computed by the proxy or sent by the client, a batch with fewer rows than
workers, and small microbatches so the workers run different numbers of model calls.

The workers score through the chunked LM head (chunks of a few rows, forward and backward), the
reference through whole logits, so the same comparison covers the head's hooks and its tied
weight's gradient under DDP and FSDP2.

All-reduce sums in a different order than one engine does, so results agree to fp32 rounding,
not bit for bit: metrics and grad norms to 1e-5 relative; weights after three AdamW steps at lr
1e-3 to 5e-5 absolute at worst and 1e-6 for 99.9% of them (AdamW divides by the gradient's
running RMS, so an element whose gradient is near zero turns rounding noise into up to a step;
the steps themselves move weights by more than 1e-3).
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.engine.builtin import BUILTIN_MODELS
from arctic_platform.layout import training_batch
from tests.ray.cluster import ray_backend
from tests.waiting import wait_until

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TINY = "builtin:tiny"
WEIGHT_ATOL = 5e-5
WEIGHT_P999 = 1e-6
REL = 1e-5


# A budget of ~12 rows of the tiny model's logits per chunk.
CHUNKED_LOGITS = {"optimization": "memory", "peak_mem_size_in_gib": 1e-5}


def client_config(backend: dict, *, logits: dict | None = None, **sections) -> dict:
    # A small token budget: several microbatches per call, different counts per worker.
    training = {"optimizer": {"lr": 1e-3}, "max_tokens_per_microbatch": 40}
    return {
        "model": TINY,
        "seed": 3,
        "tensor_type": "numpy",
        "backend": backend,
        "training": training if logits is None else {**training, "logits": logits},
        **sections,
    }


def make_batches() -> list[dict]:
    rng = np.random.default_rng(7)

    def one(rows: int) -> dict:
        prompts = [rng.integers(5, 100, rng.integers(2, 7)).tolist() for _ in range(rows)]
        responses = [rng.integers(5, 100, rng.integers(1, 12)).tolist() for _ in range(rows)]
        advantages = rng.normal(size=rows).astype(np.float32)
        return training_batch(prompts, responses, pad_token_id=0, advantages=advantages)

    return [one(6), one(5), one(7), one(1)]


def with_old_log_probs(batch: dict, logprobs: np.ndarray, seed: int) -> dict:
    noise = np.random.default_rng(seed).normal(0, 0.05, logprobs.shape).astype(np.float32)
    return {**batch, "old_log_probs": (logprobs + noise) * batch["response_mask"]}


def run_plan(client, batches: list[dict]) -> dict:
    """Three optimizer steps, then log-probs and a checkpoint; every response."""
    a, b, c, d = batches
    token_mean = {"loss_fn": "verl_grpo"}
    seq_mean = {"pad_token_id": 0, "actor_config": {"loss_agg_mode": "seq-mean-token-sum-norm"}}
    seq_mean["batch_num_tokens"] = int(c["response_mask"].sum())
    seq_mean["global_batch_size"] = len(c["input_ids"])
    out = {
        "fwd_bwd_a": client.fwd_bwd({"batch": a, "processing": token_mean}),
        "fwd_bwd_b": client.fwd_bwd({"batch": b, "processing": token_mean}),
        "step_1": client.step(),
        "fwd_bwd_c": client.fwd_bwd({"batch": c, "meta": seq_mean, "processing": token_mean}),
        "step_2": client.step(),
        "fwd_bwd_d": client.fwd_bwd({"batch": d, "processing": token_mean}),  # 1 row, 2 workers
        "step_3": client.step(),
        "forward_c": client.fwd_no_grad({"batch": c, "processing": token_mean}),
        "forward_d": client.fwd_no_grad({"batch": d}),
    }
    out["save"] = client.save_checkpoint()
    out["weights"] = load_file(f"{out['save']['path']}/model.safetensors")
    return out


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """The request batches, with old log-probs scored by the initial model (plus noise)."""
    config = client_config(
        {"type": "inprocess", "data_dir": str(tmp_path_factory.mktemp("old")), "device": "cpu"}
    )
    with create_arctic_rl_client(config, blocking_calls=True) as scorer:
        return [
            with_old_log_probs(b, scorer.fwd_no_grad({"batch": b})["batch"]["logprobs"], i)
            for i, b in enumerate(make_batches())
        ]


@pytest.fixture(scope="module")
def reference(batches, tmp_path_factory):
    config = client_config(
        {"type": "inprocess", "data_dir": str(tmp_path_factory.mktemp("ref")), "device": "cpu"}
    )
    with create_arctic_rl_client(config, blocking_calls=True) as client:
        yield run_plan(client, batches)


@pytest.fixture(scope="module")
def ddp(ray_cluster, tmp_path_factory):
    backend = ray_backend(tmp_path_factory.mktemp("ddp"), num_training_workers=2)
    client = create_arctic_rl_client(
        client_config(backend, logits=CHUNKED_LOGITS), blocking_calls=True
    )
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def fsdp(ray_cluster, tmp_path_factory):
    backend = ray_backend(
        tmp_path_factory.mktemp("fsdp"), num_training_workers=2, data_parallel="fsdp", colocate=True
    )
    client = create_arctic_rl_client(
        client_config(backend, logits=CHUNKED_LOGITS, sampling={}), blocking_calls=True
    )
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def runs(reference, batches, ddp, fsdp):
    return {"ddp": run_plan(ddp, batches), "fsdp": run_plan(fsdp, batches)}


def assert_close_metrics(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), where
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=REL, abs=1e-7), (where, name)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_workers_train_like_one_engine(runs, reference, kind):
    run = runs[kind]
    for call in ("fwd_bwd_a", "fwd_bwd_b", "fwd_bwd_c", "fwd_bwd_d"):
        assert set(run[call]) == {"job_id", "avg_loss", "loss", "metrics"}
        assert_close_metrics(run[call]["metrics"], reference[call]["metrics"], f"{kind} {call}")
    for call in ("step_1", "step_2", "step_3"):
        assert run[call]["global_steps"] == reference[call]["global_steps"]
        assert run[call]["grad_norm"] == pytest.approx(reference[call]["grad_norm"], rel=REL)
    assert set(run["weights"]) == set(reference["weights"])
    diffs = np.concatenate(
        [np.abs(run["weights"][n] - reference["weights"][n]).ravel() for n in reference["weights"]]
    )
    worst = diffs.max()
    assert worst <= WEIGHT_ATOL, (kind, worst)
    assert np.percentile(diffs, 99.9) <= WEIGHT_P999, (kind, np.percentile(diffs, 99.9))


def test_the_comparison_is_not_vacuous(reference, tmp_path_factory):
    """Three steps move the weights far more than the tolerance the workers are held to."""
    initial = create_arctic_rl_client(
        client_config(
            {"type": "inprocess", "data_dir": str(tmp_path_factory.mktemp("i")), "device": "cpu"}
        ),
        blocking_calls=True,
    )
    with initial:
        weights = load_file(f"{initial.save_checkpoint()['path']}/model.safetensors")
    moved = max(np.abs(weights[n] - reference["weights"][n]).max() for n in weights)
    assert moved > 20 * WEIGHT_ATOL


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_forward_rows_come_back_in_order(runs, reference, kind):
    for call in ("forward_c", "forward_d"):
        got, want = runs[kind][call]["batch"]["logprobs"], reference[call]["batch"]["logprobs"]
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{kind} {call}")
    assert_close_metrics(
        runs[kind]["forward_c"]["metrics"], reference["forward_c"]["metrics"], kind
    )


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_checkpoint_round_trip(runs, batches, ddp, fsdp, kind):
    """Rank 0 (DDP) or the gathered shards (FSDP) saved; every rank loads it back."""
    client = {"ddp": ddp, "fsdp": fsdp}[kind]
    saved = runs[kind]["save"]
    before = client.fwd_no_grad({"batch": batches[2]})["batch"]["logprobs"]
    client.fwd_bwd({"batch": batches[0], "processing": {"loss_fn": "verl_grpo"}})
    assert client.step()["global_steps"] == 4
    moved = client.fwd_no_grad({"batch": batches[2]})["batch"]["logprobs"]
    assert np.abs(moved - before).max() > 1e-4
    loaded = client.load_checkpoint(checkpoint_id=saved["checkpoint_id"])
    assert loaded["global_step"] == 3
    np.testing.assert_array_equal(
        client.fwd_no_grad({"batch": batches[2]})["batch"]["logprobs"], before
    )


def test_fsdp_weight_sync_reaches_the_sampler(runs, fsdp):
    prompts, params = [[40, 41, 42]], {"n": 4, "max_tokens": 6, "seed": 11}
    before = fsdp.generate(prompts, params)
    synced = fsdp.sync_weights()
    assert synced["status"] == "ok"
    (target,) = synced["targets"]
    assert target["sub_job_id"] == fsdp.sampling_job_id and target["complete"] is True
    assert fsdp.generate(prompts, params) != before


def live_groups(client) -> dict:
    """The client's job's reserved placement group(s), named after the job."""
    import ray

    name = f"arctic-platform/{client.training_job_id.split(':')[0]}"
    table = ray.util.placement_group_table()
    return {pg: i for pg, i in table.items() if i["state"] == "CREATED" and i["name"] == name}


def test_colocated_job_shares_devices(fsdp):
    """One placement group: rank 0 and the sampler share bundle 0, rank 1 has bundle 1, at the
    reference's 0.34 / 0.33 shares; every actor runs inside its bundle (none of it is free)."""
    import ray

    ((group_id, group),) = live_groups(fsdp).items()
    assert group["strategy"] == "PACK"
    assert group["bundles"] == {0: {"CPU": 0.67}, 1: {"CPU": 0.34}}
    total, free = ray.cluster_resources(), ray.available_resources()
    for index, size in ((0, 0.67), (1, 0.34)):
        key = f"CPU_group_{index}_{group_id}"
        assert total[key] == pytest.approx(size)
        assert free.get(key, 0.0) == pytest.approx(0.0, abs=1e-6)


def test_a_job_on_separate_devices_reserves_one_bundle_per_actor(ddp):
    """Without colocation the job still reserves all its actors at once: one bundle per rank
    at the training share, each used up by its rank."""
    import ray

    ((group_id, group),) = live_groups(ddp).items()
    assert group["bundles"] == {0: {"CPU": 0.34}, 1: {"CPU": 0.34}}
    free = ray.available_resources()
    assert all(free.get(f"CPU_group_{i}_{group_id}", 0.0) < 1e-6 for i in (0, 1))


def _step_in_a_task(config, state):
    from arctic_platform.client import create_arctic_rl_client

    client = create_arctic_rl_client(config, state, blocking_calls=True)
    answer = client.step()
    client.shutdown()  # an attached client leaves the jobs running
    return answer


def test_a_ray_task_reconnects_to_the_same_job(runs, ddp):
    import ray

    steps = ddp.step()["global_steps"]
    task = ray.remote(num_cpus=0)(_step_in_a_task)
    answer = ray.get(task.remote(ddp.reconnect_config(), ddp.get_server_state()))
    assert answer["job_id"] == ddp.training_job_id
    assert answer["global_steps"] == steps + 1
    assert ddp.step()["global_steps"] == steps + 2  # still running after the task's shutdown


def test_bad_input_changes_nothing_on_any_rank(runs, batches, ddp):
    """Refused by the proxy before any worker runs, or, for a shard only one rank finds bad, by
    every rank together: no rank accumulates a gradient from a request that failed."""
    import ray

    from arctic_platform.client import InvalidRequestError
    from arctic_platform.server.ray_workers import Rejected

    before = ddp.fwd_no_grad({"batch": batches[2]})["batch"]["logprobs"]
    bad = dict(batches[0], input_ids=np.where(batches[0]["attention_mask"] == 1, 500, 0))
    with pytest.raises(InvalidRequestError, match="batch.input_ids"):
        ddp.fwd_bwd({"batch": bad, "processing": {"loss_fn": "verl_grpo"}})
    context = BUILTIN_MODELS["tiny"].max_position_embeddings
    ids = np.ones((1, context + 1), dtype=np.int64)
    long = {"input_ids": ids, "attention_mask": ids, "labels": ids}
    with pytest.raises(InvalidRequestError, match=rf"row 0 is {context + 1} tokens, more than"):
        ddp.fwd_bwd({"batch": long})  # refused before the proxy splits it

    kind, workers = ray.get(ddp.get_server_state().actors.remote(ddp.training_job_id))
    assert kind == "ok" and len(workers) == 2
    meta = {"dp_size": 2, "batch_num_tokens": 10.0, "global_batch_size": 4}
    good = {k: v[:2] for k, v in batches[0].items()}
    shards = [good, {k: v[2:4] for k, v in bad.items()}]
    replies = ray.get(
        [
            w.call.remote("forward_backward", s, meta, {"loss_fn": "verl_grpo"})
            for w, s in zip(workers, shards, strict=True)
        ]
    )
    assert replies[0] == Rejected("peer", "", replies[0].message)
    assert replies[1].kind == "input" and replies[1].field == "batch.input_ids"

    steps = ddp.step()  # nothing accumulated anywhere: a zero gradient, weights unchanged
    assert steps["grad_norm"] == 0.0
    after = ddp.fwd_no_grad({"batch": batches[2]})["batch"]["logprobs"]
    np.testing.assert_array_equal(after, before)


def test_shutdown_gives_the_devices_back(fsdp):
    """The creating client's shutdown ends its job, killing the actors and the placement group
    (this test uses up the FSDP client, so it runs last)."""
    assert live_groups(fsdp)
    fsdp.shutdown()
    wait_until(
        lambda: not live_groups(fsdp),
        what="the placement groups gone",
        timeout_s=30,
        interval_s=0.1,
    )
