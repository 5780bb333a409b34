"""The Ray workers relay an engine's Protocol methods through one generic ``call``, derived from
the Protocols (``contract/engine_protocols.py``) rather than a hand-kept list.

The worker classes are plain (``ray.remote`` makes them actors elsewhere), so they are driven
here directly, each holding a stand-in engine that records its calls; the Ray suites run the same
relay in real actors.
"""

from __future__ import annotations

import numpy as np
import pytest

from arctic_platform.contract.engine_protocols import (
    LogProbEngineProtocol,
    SamplingEngineProtocol,
    TrainingEngineProtocol,
    protocol_methods,
)
from arctic_platform.contract.problems import FieldError
from arctic_platform.server.ray_workers import RELAYED, InferenceWorker, Rejected, TrainingWorker


def test_the_relayed_methods_are_the_protocols_but_what_the_proxy_does_itself():
    assert RELAYED["training"] == {
        "forward_backward",
        "forward",
        "step",
        "save_checkpoint",
        "load_checkpoint",
        "sleep",
        "wake",
        "empty_cache",
    }
    assert RELAYED["sampling"] == {
        "generate",
        "prompt_logprobs",
        "sleep",
        "wake",
        "reset_prefix_cache",
    }
    assert RELAYED["log_prob"] == {"forward", "log_probs"}
    # The Protocols declare the rest: closing and weight snapshots stay with the proxy.
    assert protocol_methods(TrainingEngineProtocol) - RELAYED["training"] == {
        "close",
        "sync_weights_to",
        "weight_snapshot",
    }
    assert protocol_methods(SamplingEngineProtocol) - RELAYED["sampling"] == {"close"}
    assert protocol_methods(LogProbEngineProtocol) - RELAYED["log_prob"] == {"close"}


class Recorder:
    """A stand-in engine: records each call, answers with what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def step(self, learning_rate=None, *, adam=None):
        self.calls.append(("step", learning_rate, adam))
        return {"global_steps": 1, "last_lr": learning_rate}

    def forward_backward(self, batch, meta=None, processing=None, *, with_logprobs=False):
        batch["input_ids"][0, 0] = 9  # the engine may write its batch
        self.calls.append(("forward_backward", with_logprobs))
        return {"loss": float(batch["input_ids"].sum())}

    def generate(self, prompts, sampling_params=None):
        raise FieldError("sampling_params.top_p", "must be in (0, 1], got 7")

    def load_weights(self, weights):
        raise AssertionError("not relayed")


def test_a_training_rank_relays_positional_and_keyword_arguments():
    worker = TrainingWorker(rank=0, world_size=1)
    worker.engine = Recorder()
    assert worker.call("step", 0.5, adam={"beta1": 0.8}) == {"global_steps": 1, "last_lr": 0.5}
    read_only = np.zeros((1, 3), np.int64)
    read_only.flags.writeable = False  # as an array from the object store arrives
    answer = worker.call("forward_backward", {"input_ids": read_only}, {}, {}, with_logprobs=True)
    assert answer == {"loss": 9.0} and not read_only.any()  # the engine wrote a copy
    assert worker.engine.calls == [("step", 0.5, {"beta1": 0.8}), ("forward_backward", True)]


def test_a_replica_refuses_what_its_protocol_does_not_declare_and_returns_field_errors():
    worker = InferenceWorker("sampling")
    worker.engine = Recorder()
    with pytest.raises(AttributeError, match="no relayed method 'load_weights'"):
        worker.call("load_weights", {})
    with pytest.raises(AttributeError, match="no relayed method 'step'"):
        worker.call("step", 1.0)
    assert worker.call("generate", [[1]], {"top_p": 7}, op_id="op-1") == Rejected(
        "input", "sampling_params.top_p", "must be in (0, 1], got 7"
    )
