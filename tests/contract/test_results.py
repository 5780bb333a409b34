"""Result shapes are built in one place: our server's answers and a reference server's (which
omits aliases) come out with every name frameworks read."""

from __future__ import annotations

from arctic_platform.contract import results


def test_our_fwd_bwd_result_carries_both_loss_names():
    out = results.fwd_bwd_result("j:training:0", {"metrics": {"loss": 0.25, "actor/pg_loss": 1}})
    assert out == {
        "job_id": "j:training:0",
        "avg_loss": 0.25,
        "loss": 0.25,
        "metrics": {"loss": 0.25, "actor/pg_loss": 1},
    }


def test_a_forward_without_a_loss_reports_zero_and_only_its_outputs():
    out = results.forward_result("j", {"logprobs": [1.0], "metrics": {}, "other": 3})
    assert out == {
        "job_id": "j",
        "batch": {"logprobs": [1.0]},
        "metrics": {},
        "avg_loss": 0.0,
        "loss": 0.0,
    }


def test_a_reference_servers_answers_get_the_aliases():
    cortex_fwd_bwd = {"job_id": "j", "avg_loss": 0.5, "metrics": {}, "post_process_outputs": {}}
    assert results.shape_train_result(cortex_fwd_bwd)["loss"] == 0.5
    metrics_only = results.shape_train_result({"metrics": {"loss": 0.75}})
    assert (metrics_only["loss"], metrics_only["avg_loss"]) == (0.75, 0.75)
    outputs = results.shape_train_result({"model_outputs": {"logprobs": [0.0]}})
    assert outputs["batch"] is outputs["model_outputs"]
    step = results.shape_step_result(
        {"global_steps": 3, "last_lr": 1e-5, "metrics": {"grad_norm": 2}}
    )
    assert step["grad_norm"] == 2 and step["metrics"]["last_lr"] == 1e-5
