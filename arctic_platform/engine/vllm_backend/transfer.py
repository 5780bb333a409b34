"""How synced weights reach the vLLM process, and the trainer side of vLLM's GPU transfers.

``sampling.vllm.weight_sync`` names the path; :func:`resolve_weight_sync` turns ``auto`` into one
by device: on CPU ``reload`` (the staged files into the running engine, then the re-pack of the
CPU kernels: a fraction of a second on a small model, where ``restart`` takes seconds), on CUDA
``ipc``. The paths:

- ``restart`` / ``reload``: the staged safetensors directory (:mod:`.staging`), loaded by a new
  engine or by vLLM's ``reload_weights``. Both are tested on CPU against a fresh engine, the
  generations (greedy and seeded samples) equal.
- ``ipc`` / ``nccl``: vLLM's weight-transfer engine (vLLM >= 0.32: engine argument
  ``weight_transfer_config={"backend": ...}``, then ``LLM.init_weight_transfer_engine`` once and
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` per sync, which load
  into the running engine in place with vLLM's layer-wise reload). Both exist only on CUDA.

  **Untested: no GPU was available where this was written.** The code follows the worker side of
  vLLM 0.32 (``vllm/distributed/weight_transfer/ipc_engine.py`` and ``nccl_engine.py``); the CPU
  tests cover the selection, the refusals and the payload fields against vLLM's own update-info
  classes, not a transfer.

  ``ipc`` (the CUDA default): the weights, on the vLLM GPU in the served dtype (the trainer's
  own tensors when they already are, else copies), are shared as CUDA IPC handles
  (``torch.multiprocessing.reductions.reduce_tensor``, keyed by the GPU's UUID, as vLLM's
  receiver looks them up) and stay alive until vLLM confirmed the update. Works whatever device
  the trainer's tensors are on, within one machine.

  ``nccl``: an NCCL group of this process (rank 0, on the GPU that holds the trainer's weights)
  and the vLLM workers, joined from an ``ncclUniqueId`` this process mints (vLLM's rendezvous for
  trainers that do not run vLLM's own trainer engine, which needs vLLM installed here; ours runs
  in another environment). vLLM's warm-up handshake (a one-element ``all_reduce``) follows the
  init; each sync then broadcasts the tensors one by one (vLLM's unpacked mode) while the worker
  receives them. The trainer's GPU must differ from vLLM's (NCCL cannot have two ranks on one GPU).

Both transfer paths send every weight: vLLM's layer-wise reload processes a layer from whatever
arrived for it, so a partial sync that covers part of a fused layer would corrupt it; partial
syncs are refused (use ``restart`` or ``reload`` for them). A transfer that fails part-way leaves
the served weights undefined (vLLM's layer-wise reload leaves meta tensors behind; the CPU test
shows it); one that fails before anything was sent (``ipc``'s copy of the weights onto vLLM's
GPU running out of memory) leaves them as they were. With an explicit ``ipc`` / ``nccl`` the
engine raises either failure, and after one part-way refuses to generate until a complete sync
succeeds. With ``auto`` it does not stake the run on these untested paths: a failure at start
(a vLLM without ``weight_transfer_config`` included) or at a sync (the copy onto vLLM's GPU
included) drops the transfer path and that sync, and every later one, goes through
:data:`FALLBACK_WEIGHT_SYNC` instead (``reload``: the staged files into the running engine, the GPU
default before these paths existed; it also brings an engine out of that meta-tensor state, which
the CPU tests check against a fresh engine).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.vllm_backend.process import WorkerProcess

WEIGHT_SYNC_FIELD = "sampling.vllm.weight_sync"
TRANSFER_PATHS = ("ipc", "nccl")  # through vLLM's weight-transfer engine (CUDA only)
FALLBACK_WEIGHT_SYNC = "reload"  # where ``auto`` goes when its transfer path fails
TRANSFER_ENGINE_ARG = "weight_transfer_config"  # vLLM's engine argument for its receiver (>= 0.32)


def resolve_weight_sync(requested: str, device: torch.device) -> str:
    """The path ``requested`` (a ``weight_sync`` value) means on ``device``: ``auto`` is
    ``reload`` on CPU and ``ipc`` on CUDA; a transfer path anywhere but CUDA is refused."""
    if requested == "auto":
        return "ipc" if device.type == "cuda" else "reload"
    if requested in TRANSFER_PATHS and device.type != "cuda":
        raise EngineInputError(
            WEIGHT_SYNC_FIELD,
            f"{requested!r} is vLLM's CUDA weight transfer and this engine runs on "
            f"{device.type}; use 'restart', 'reload' or 'auto'",
        )
    return requested


def vllm_gpu(device: torch.device) -> torch.device:
    """The GPU vLLM runs on, as this process numbers it: the job's, or the first visible one
    when the job names none (the worker then sees every GPU and vLLM takes the first)."""
    return device if device.index is not None else torch.device(device.type, 0)


def transfer_engine_args(method: str) -> dict:
    """The vLLM engine arguments ``method`` needs (vLLM builds its receiver at startup)."""
    if method in TRANSFER_PATHS:
        return {TRANSFER_ENGINE_ARG: {"backend": method}}
    return {}


def optional_engine_args(requested: str, method: str, user_args: Mapping) -> list[str]:
    """The engine arguments the worker may drop when its vLLM lacks them (instead of refusing
    them as unknown): under ``auto`` the transfer path's own, which the user never set, so that
    a vLLM older than 0.32 starts and ``auto`` falls back to :data:`FALLBACK_WEIGHT_SYNC`. An
    explicit path, or the argument set in the user's ``engine_args``, stays strict."""
    if requested == "auto" and method in TRANSFER_PATHS and TRANSFER_ENGINE_ARG not in user_args:
        return [TRANSFER_ENGINE_ARG]
    return []


def update_info(tensors: Mapping[str, torch.Tensor]) -> dict:
    """The per-sync fields vLLM's update-info classes share: names, dtype names and shapes,
    in the order the tensors are sent."""
    return {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
    }


def ipc_update_info(tensors: Mapping[str, torch.Tensor], gpu_uuid: str) -> dict:
    """vLLM's ``IPCWeightTransferUpdateInfo`` (unpacked) for ``tensors`` (on the vLLM GPU): one
    ``{gpu_uuid: rebuild args}`` handle per tensor, pickled for our JSON channel (the worker
    unpickles them; both ends are this sampling job's own processes)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = [{gpu_uuid: reduce_tensor(t)[1]} for t in tensors.values()]
    return {
        **update_info(tensors),
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
    }


class IpcTransfer:
    """The ``ipc`` path (see the module docstring). Untested on GPU."""

    def __init__(self, process: WorkerProcess, device: torch.device) -> None:
        self._process = process
        self.device = vllm_gpu(device)
        self._gpu_uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        process.call("init_transfer", init_info={"packed": False})

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """``tensors`` are on the vLLM GPU in the served dtypes; they must outlive the call."""
        self._process.call("transfer", update_info=ipc_update_info(tensors, self._gpu_uuid))
        torch.cuda.ipc_collect()  # release the IPC references vLLM dropped

    def close(self) -> None:
        """Nothing is held between syncs."""


class NcclTransfer:
    """The ``nccl`` path (see the module docstring). Untested on GPU.

    The group is formed at the first sync, on the GPU of the first tensor it sends."""

    def __init__(self, process: WorkerProcess, vllm_device: torch.device, workers: int) -> None:
        self._process = process
        self._vllm_device = vllm_gpu(vllm_device)
        self._world_size = 1 + workers  # this process is rank 0, vLLM's workers follow
        self._comm = None
        self._device: torch.device | None = None

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Broadcast ``tensors`` (on one GPU, not vLLM's) while the worker receives them."""
        device = next(iter(tensors.values())).device
        if self._comm is None:
            self._connect(device)
        elif device != self._device:
            raise EngineInputError(
                "weights", f"the NCCL group was formed on {self._device}; these are on {device}"
            )
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            receiving = pool.submit(
                self._process.call, "transfer", update_info=update_info(tensors)
            )
            with torch.cuda.device(device):
                for tensor in tensors.values():
                    if receiving.done():  # the worker refused before its first receive
                        break
                    torch.cuda.nccl.broadcast([tensor], root=0, comms=[self._comm])
                # The worker's reply first: after a failure there, broadcasts it will never
                # receive stay queued, and waiting on them would hang (vLLM's own trainer engine
                # has the same limit; the group is unusable after it).
                receiving.result()
                torch.cuda.synchronize(device)
        finally:
            pool.shutdown(wait=False)  # a worker stuck in NCCL must not hang this thread too

    def _connect(self, device: torch.device) -> None:
        if device.type != "cuda" or device == self._vllm_device:
            raise EngineInputError(
                WEIGHT_SYNC_FIELD,
                f"'nccl' needs the weights on a GPU other than vLLM's ({self._vllm_device}); "
                f"they are on {device}: use 'ipc'",
            )
        unique_id = torch.cuda.nccl.unique_id()
        init_info = {
            "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
            "rank_offset": 1,
            "world_size": self._world_size,
            "packed": False,
        }
        # Both sides block in ncclCommInitRank until every rank joined, so the worker's init
        # runs beside ours; then the warm-up all_reduce vLLM's communicator issues after init.
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            joining = pool.submit(self._process.call, "init_transfer", init_info=init_info)
            with torch.cuda.device(device):
                comm = torch.cuda.nccl.init_rank(self._world_size, unique_id, 0)
                torch.cuda.nccl.all_reduce([torch.zeros(1, device=device)], comms=[comm])
                torch.cuda.synchronize(device)
            joining.result()
        finally:
            pool.shutdown(wait=False)
        self._comm, self._device = comm, device

    def close(self) -> None:
        """The communicator goes with this process's NCCL state; vLLM's with its process."""
        self._comm = None
