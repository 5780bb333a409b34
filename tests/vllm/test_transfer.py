"""The choice of weight-sync path, and vLLM's weight-transfer protocol as far as a CPU reaches.

The CUDA paths (``ipc``, ``nccl``; :mod:`arctic_platform.engine.vllm_backend.transfer`) cannot
move a tensor without a GPU, and none was available. What runs here: ``auto`` resolves by device
and the CUDA paths are refused on CPU naming the setting; and a vLLM worker started with vLLM's
weight-transfer engine (``backend: ipc``) takes our worker ops and payloads through vLLM's real
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``: vLLM's own update-info class rejects a payload whose fields disagree,
such a failure leaves the served weights undefined (why the engine then refuses to generate), and
a complete round (here with no tensors: vLLM's layer-wise reload puts every layer back) restores
the output the engine gave before.

The engine's handling of such failures runs on CPU too, with a stand-in for the CUDA sender that
drives the real worker: under ``auto`` a failed transfer (at start, or part-way through a sync)
falls back to ``reload`` and the sync's weights are then served as a fresh engine serves them; an
explicit ``ipc`` stays strict and refuses to generate until a complete transfer succeeds.
"""

from __future__ import annotations

import logging

import pytest
import torch

from arctic_platform.engine.config import ModelConfig
from arctic_platform.engine.errors import EngineInputError, SamplerStateError
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine
from arctic_platform.engine.vllm_backend.process import VllmWorkerError
from arctic_platform.engine.vllm_backend.transfer import (
    TRANSFER_ENGINE_ARG,
    WEIGHT_SYNC_FIELD,
    ipc_update_info,
    optional_engine_args,
    resolve_weight_sync,
    transfer_engine_args,
    vllm_gpu,
)
from arctic_platform.engine.vllm_backend.worker import known_engine_args
from arctic_platform.engine.weights import export_weights
from tests.vllm.conftest import (
    SYNC_GREEDY,
    SYNC_PROMPTS,
    assert_same_generation,
    greedy_tokens_and_logprobs,
    needs_vllm,
    save_model_dir,
    vllm_config,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_picks_reload_on_cpu_and_ipc_on_cuda():
    assert resolve_weight_sync("auto", CPU) == "reload"
    assert resolve_weight_sync("auto", CUDA) == "ipc"
    for explicit in ("restart", "reload"):
        assert resolve_weight_sync(explicit, CPU) == resolve_weight_sync(explicit, CUDA) == explicit
    assert resolve_weight_sync("nccl", CUDA) == "nccl"
    assert transfer_engine_args("ipc") == {"weight_transfer_config": {"backend": "ipc"}}
    assert transfer_engine_args("restart") == {}
    # vLLM runs on the first visible GPU when the job names none: that is the one to send to.
    assert vllm_gpu(torch.device("cuda")) == CUDA
    assert vllm_gpu(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_only_auto_lets_a_vllm_without_the_transfer_argument_start():
    # Under auto the transfer's engine argument is the job's, so the worker may drop it ...
    assert optional_engine_args("auto", "ipc", {}) == [TRANSFER_ENGINE_ARG]
    # ... never the user's own, nor one an explicit path needs, nor where auto sends no transfer.
    assert optional_engine_args("auto", "ipc", {TRANSFER_ENGINE_ARG: {"backend": "ipc"}}) == []
    assert optional_engine_args("ipc", "ipc", {}) == optional_engine_args("nccl", "nccl", {}) == []
    assert optional_engine_args("auto", "restart", {}) == []

    # The worker's side, as a vLLM older than 0.32 (no weight_transfer_config) sees the args.
    old_vllm = {"dtype", "seed", "max_model_len"}
    args = {"dtype": "float32", "seed": 0, **transfer_engine_args("ipc")}
    assert known_engine_args(args, old_vllm, [TRANSFER_ENGINE_ARG]) == (
        {"dtype": "float32", "seed": 0},
        [TRANSFER_ENGINE_ARG],
    )
    assert known_engine_args(args, old_vllm | {TRANSFER_ENGINE_ARG}, [TRANSFER_ENGINE_ARG]) == (
        args,
        [],
    )
    with pytest.raises(ValueError, match="vllm_config.weight_transfer_config: not an engine arg"):
        known_engine_args(args, old_vllm, [])
    with pytest.raises(ValueError, match=r"vllm_config.typo: .*\(unknown: \['typo'\]\)"):
        known_engine_args({**args, "typo": 1}, old_vllm, [TRANSFER_ENGINE_ARG])


@pytest.mark.parametrize("path", ["ipc", "nccl"])
def test_cuda_paths_are_refused_on_cpu_before_vllm_starts(path):
    with pytest.raises(EngineInputError, match=f"'{path}' is vLLM's CUDA weight transfer") as info:
        VllmSamplingEngine(vllm_config("builtin:tiny", weight_sync=path))
    assert info.value.field == WEIGHT_SYNC_FIELD == "sampling.vllm.weight_sync"


@needs_vllm
@pytest.mark.slow
def test_vllm_takes_our_transfer_ops_and_payloads(shared_engine):
    worker = shared_engine._process  # the worker's own ops, below the engine's CPU refusal
    request = [{"prompt_token_ids": [40, 41, 42], "params": {"max_tokens": 8, "temperature": 0.0}}]
    before = worker.call("generate", requests=request)
    assert worker.call("init_transfer", init_info={"packed": False}) == {"initialized": True}

    mismatched = {**ipc_update_info({}, "GPU-none"), "names": ["model.norm.weight"]}
    with pytest.raises(VllmWorkerError, match="`dtype_names` should be of the same size"):
        worker.call("transfer", update_info=mismatched)
    with pytest.raises(VllmWorkerError, match="Meta tensors"):  # the weights are undefined
        worker.call("generate", requests=request)

    empty = ipc_update_info({}, "GPU-none")
    assert worker.call("transfer", update_info=empty) == {"method": "ipc"}
    assert worker.call("generate", requests=request) == before


class StandInIpcSender:
    """Stands in for :class:`~arctic_platform.engine.vllm_backend.transfer.IpcTransfer`, which
    needs CUDA (no GPU here): it drives the real worker's ``transfer`` op with the tensors' names
    but no dtypes or handles, a payload vLLM accepts far enough to take the layers apart
    (``start_weight_update``) and then refuses, as a failing CUDA transfer would leave it."""

    device = CPU

    def __init__(self, worker, malformed: bool = True) -> None:
        worker.call("init_transfer", init_info={"packed": False})
        self.worker, self.malformed, self.sent = worker, malformed, 0

    def send(self, tensors) -> None:
        self.sent += 1
        names = list(tensors) if self.malformed else []  # else vLLM's complete empty round
        payload = {**ipc_update_info({}, "GPU-none"), "names": names}
        self.worker.call("transfer", update_info=payload)

    def close(self) -> None:
        """Nothing held."""


@pytest.fixture
def as_ipc(shared_engine, monkeypatch):
    """The shared engine as if ``auto`` had resolved to ``ipc``, restored afterwards."""
    for name in ("weight_sync", "weight_sync_fallback", "_transfer", "info"):
        monkeypatch.setattr(shared_engine, name, getattr(shared_engine, name))
    shared_engine.weight_sync = "ipc"
    return shared_engine


@needs_vllm
@pytest.mark.slow
def test_auto_completes_a_failed_transfer_by_reload(as_ipc, perturbed_model_dir, tmp_path, caplog):
    engine = as_ipc
    assert engine.weight_sync_requested == "auto"
    engine._transfer = sender = StandInIpcSender(engine._process)
    before = greedy_tokens_and_logprobs(engine)
    model = load_causal_lm(ModelConfig(name=perturbed_model_dir))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    with caplog.at_level(logging.WARNING):
        report = engine.load_weights(iter(dict(export_weights(model)).items()))  # read once
    assert sender.sent == 1 and report["complete"] and report["method"] == "reload"
    reason = engine.weight_sync_fallback
    assert "ipc weight transfer failed part-way" in reason
    assert "`dtype_names` should be of the same size" in reason  # vLLM's own refusal
    assert engine.info["weight_sync_fallback"] == reason and engine.info["weight_sync"] == "reload"
    assert reason in caplog.text and "sampling.vllm.weight_sync is 'auto'" in caplog.text
    synced = greedy_tokens_and_logprobs(engine)
    assert synced[0] != before[0]  # the sync changed the policy, so the comparison can fail

    fresh = VllmSamplingEngine(vllm_config(save_model_dir(model, tmp_path / "synced")))
    try:
        assert_same_generation(synced, greedy_tokens_and_logprobs(fresh))
    finally:
        fresh.close()
    # Later syncs go through reload, never the transfer again: back to the original weights.
    original = load_causal_lm(ModelConfig(name=perturbed_model_dir))
    assert engine.load_weights(dict(export_weights(original)))["method"] == "reload"
    assert sender.sent == 1
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)


@needs_vllm
@pytest.mark.slow
def test_an_explicit_ipc_stays_strict_when_a_transfer_fails(as_ipc, monkeypatch):
    engine = as_ipc
    monkeypatch.setattr(engine, "weight_sync_requested", "ipc")
    before = greedy_tokens_and_logprobs(engine)
    engine._transfer = StandInIpcSender(engine._process)
    weights = dict(export_weights(load_causal_lm(ModelConfig(name=engine.config.model.name))))
    with pytest.raises(SamplerStateError, match="ipc weight transfer failed part-way"):
        engine.load_weights(weights)
    assert engine.weight_sync == "ipc" and engine.weight_sync_fallback is None
    with pytest.raises(SamplerStateError, match="run a complete weight sync"):
        engine.generate(SYNC_PROMPTS, SYNC_GREEDY)
    engine._transfer.malformed = False  # a complete round: served weights are defined again
    assert engine.load_weights(weights)["method"] == "ipc"
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)


@needs_vllm
def test_auto_falls_back_when_the_transfer_cannot_start(as_ipc, monkeypatch):
    engine = as_ipc
    # The real IpcTransfer, which cannot start without CUDA.
    monkeypatch.setattr(engine, "weight_sync_requested", "ipc")
    with pytest.raises(AssertionError, match="CUDA") as strict:
        engine._start_transfer()
    assert engine.weight_sync == "ipc" and engine._transfer is None
    monkeypatch.setattr(engine, "weight_sync_requested", "auto")
    engine._start_transfer()
    assert engine._transfer is None and engine.weight_sync == "reload"
    reason = f"starting the ipc weight transfer failed ({strict.value})"
    assert engine.weight_sync_fallback == reason


@needs_vllm
def test_auto_falls_back_when_this_vllm_lacks_the_transfer_argument(as_ipc):
    engine = as_ipc  # as the worker reports a vLLM < 0.32 that dropped the argument at start
    engine._start_transfer(dropped=[TRANSFER_ENGINE_ARG])
    assert engine._transfer is None and engine.weight_sync == "reload"
    version = engine.info["vllm_version"]
    assert engine.weight_sync_fallback == (
        f"this vLLM ({version}) has no engine argument 'weight_transfer_config' "
        "(vLLM >= 0.32 has it)"
    )
    assert engine.info["weight_sync_fallback"] == engine.weight_sync_fallback


class StandInFullGpuSender(StandInIpcSender):
    """A sender whose GPU cannot take the copies: CUDA's out-of-memory error (a RuntimeError)
    cannot happen on CPU, so its device is one this torch build cannot copy to at all, whose
    copy raises a RuntimeError too."""

    device = torch.device("ipu")


@needs_vllm
@pytest.mark.slow
def test_a_failed_copy_onto_the_vllm_gpu_keeps_or_falls_back(as_ipc, monkeypatch):
    engine = as_ipc
    before = greedy_tokens_and_logprobs(engine)
    original = dict(export_weights(load_causal_lm(ModelConfig(name=engine.config.model.name))))
    scaled = {name: tensor * 1.5 for name, tensor in original.items()}

    # Explicit ipc: the copy's error is the user's; nothing was sent, the weights stay served.
    monkeypatch.setattr(engine, "weight_sync_requested", "ipc")
    engine._transfer = sender = StandInFullGpuSender(engine._process)
    with pytest.raises(RuntimeError, match="not linked with support for ipu"):
        engine.load_weights(scaled)
    assert sender.sent == 0 and engine.weight_sync == "ipc" and engine.weight_sync_fallback is None
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)

    # auto: the same sync goes through reload, from a stream read once.
    monkeypatch.setattr(engine, "weight_sync_requested", "auto")
    report = engine.load_weights(iter(scaled.items()))
    assert sender.sent == 0 and report["complete"] and report["method"] == "reload"
    assert engine.weight_sync_fallback.startswith(
        "copying the weights for the ipc weight transfer failed (PyTorch is not linked"
    )
    assert greedy_tokens_and_logprobs(engine)[0] != before[0]  # the scaled weights are served
    assert engine.load_weights(original)["method"] == "reload"
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)
