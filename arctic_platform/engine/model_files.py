"""A model name as a local folder: a hub name is downloaded here, with timeouts, so that nothing
slow happens while :data:`~arctic_platform.engine.models.MODEL_INIT_LOCK` is held.

``from_pretrained`` given a hub name downloads inside the call, which the engines make under the
process-wide init lock: one hung hub endpoint then held every other job's engine build (another
tenant's ``builtin:tiny`` job stayed pending while one job's download hung). So the engines load
only local folders, and a hub name is fetched first, unlocked, by :func:`fetch_model`: the
repository's metadata with a timeout (huggingface_hub's own ``HF_HUB_ETAG_TIMEOUT``, 10 s by
default; its listing call has none of its own), then the files ``from_pretrained`` reads, each
through ``hf_hub_download`` (metadata within the same timeout, bytes within
``HF_HUB_DOWNLOAD_TIMEOUT`` of silence). A hub that does not answer fails the job that asked, with
a reason naming the hub and the timeout. No torch here: the server measures folders with it too.
"""

from __future__ import annotations

from pathlib import Path

# Alternative weight formats ``from_pretrained`` does not read when safetensors are there (and
# never reads at all: TensorFlow, Flax, ONNX, GGUF), and folders of other tools' copies.
_TORCH_WEIGHTS = (".bin", ".pt", ".pth")
_NEVER_READ = (".h5", ".msgpack", ".ot", ".onnx", ".tflite", ".gguf")


class ModelDownloadError(RuntimeError):
    """The model hub did not provide the model (no answer within the timeout)."""


def fetch_model(name: str) -> str:
    """``name`` as a folder ``from_pretrained`` loads without the network: a local folder as it
    is, a hub name downloaded (or, offline, found in the hub cache)."""
    if Path(name).exists():
        return name
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download

    if constants.HF_HUB_OFFLINE:
        return snapshot_download(name, local_files_only=True)
    import httpx

    timeout = constants.HF_HUB_ETAG_TIMEOUT
    try:
        info = HfApi().model_info(name, timeout=timeout)
    except httpx.TimeoutException:
        raise ModelDownloadError(
            f"model_name {name!r}: the model hub ({constants.ENDPOINT}) did not answer within "
            f"{timeout:g} s (HF_HUB_ETAG_TIMEOUT)"
        ) from None
    files = files_to_fetch([s.rfilename for s in info.siblings or ()])
    if not files:
        raise ModelDownloadError(f"model_name {name!r}: the hub repository has no model files")
    paths = [hf_hub_download(name, f, revision=info.sha, etag_timeout=timeout) for f in files]
    return str(Path(paths[0]).parent)


def files_to_fetch(names: list[str]) -> list[str]:
    """The repository's top-level files ``from_pretrained`` may read: configs, tokenizer files,
    code, and one weight format (safetensors when there are any)."""
    top = [n for n in names if "/" not in n and not n.endswith(_NEVER_READ)]
    if any(n.endswith(".safetensors") for n in top):
        top = [n for n in top if not n.endswith(_TORCH_WEIGHTS)]
    return sorted(top)
