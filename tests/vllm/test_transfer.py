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
"""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine
from arctic_platform.engine.vllm_backend.process import VllmWorkerError
from arctic_platform.engine.vllm_backend.transfer import (
    WEIGHT_SYNC_FIELD,
    ipc_update_info,
    resolve_weight_sync,
    transfer_engine_args,
    vllm_gpu,
)
from tests.vllm.conftest import needs_vllm, vllm_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_picks_restart_on_cpu_and_ipc_on_cuda():
    assert resolve_weight_sync("auto", CPU) == "restart"
    assert resolve_weight_sync("auto", CUDA) == "ipc"
    for explicit in ("restart", "reload"):
        assert resolve_weight_sync(explicit, CPU) == resolve_weight_sync(explicit, CUDA) == explicit
    assert resolve_weight_sync("nccl", CUDA) == "nccl"
    assert transfer_engine_args("ipc") == {"weight_transfer_config": {"backend": "ipc"}}
    assert transfer_engine_args("restart") == {}
    # vLLM runs on the first visible GPU when the job names none: that is the one to send to.
    assert vllm_gpu(torch.device("cuda")) == CUDA
    assert vllm_gpu(torch.device("cuda", 1)) == torch.device("cuda", 1)


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
