"""The weights the vLLM process serves, kept as a model directory it can load.

vLLM loads models from directories, so weight sync hands it one: each sync writes a new version
``<root>/v<N>/`` holding the model's own config and tokenizer files and one ``model.safetensors``
with every weight (what the sync brought, the rest from the previous version), and the worker loads
that (by restarting its engine on it, or by reloading its weights from it). Only after the worker
confirmed does the version become current and the older one get deleted, so a failed load leaves
the previous weights being served and on disk.

Validation happens before anything is written: names, shapes and dtypes are checked against the
model's ``state_dict`` built on the ``meta`` device (no memory), with the rules of
:func:`~arctic_platform.engine.weights.load_into_model`, so a bad sync is refused with the same
errors as on our own sampler and the vLLM process never sees it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from arctic_platform.engine.weights import WeightLoadError, Weights, collect_weights

WEIGHTS_FILE = "model.safetensors"
# Files of a model directory that hold weights; everything else (config, tokenizer) is copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class WeightStaging:
    """Versions of the served model directory under ``root`` (see the module docstring)."""

    def __init__(self, source: Path, root: Path, model_config, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.source = source
        self.root = root
        self.current = source  # the original model until the first sync
        self._version = 0
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        self._targets = meta.state_dict(keep_vars=True)

    def stage(self, weights: Weights) -> tuple[Path, dict]:
        """Validate ``weights`` and write the next version; returns ``(directory, report)``."""
        tensors, report = self.validate(weights, torch.device("cpu"))
        if not report["complete"]:
            tensors = {**self._current_tensors(exclude=tensors), **tensors}
        self._version += 1
        target = self.root / f"v{self._version}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for item in self.source.iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(item, target / item.name)
        from safetensors.torch import save_file

        save_file(tensors, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
        return target, report

    def validate(
        self,
        weights: Weights,
        device: torch.device | None,
        copy: bool = True,
        convert: bool = True,
    ) -> tuple[dict, dict]:
        """``weights`` in the served dtypes (their own with ``convert=False``) on ``device``
        (None: where each one is), tied aliases folded, and the load report; refused as our
        sampler would, nothing kept. Copies, unless ``copy`` is False and a tensor already is
        what is asked for."""
        try:
            return collect_weights(self._targets, weights, device, copy, convert)
        except WeightLoadError as err:  # nothing was staged, whatever had been read before
            raise WeightLoadError(err.field, err.reason) from err

    def served(
        self, tensors: dict[str, torch.Tensor], device: torch.device | None
    ) -> dict[str, torch.Tensor]:
        """Validated ``tensors`` in the served dtypes on ``device`` (None: where each one is);
        one already there in that dtype is kept as it is, any other is copied."""
        return {
            name: tensor.to(device, dtype=self._targets[name].dtype, copy=False).contiguous()
            for name, tensor in tensors.items()
        }

    def commit(self, version: Path) -> None:
        """``version`` is now served: it becomes current and the previous staged one goes."""
        previous, self.current = self.current, version
        if previous != self.source and previous != version:
            shutil.rmtree(previous, ignore_errors=True)

    def discard(self, version: Path) -> None:
        """A staged version the worker did not take."""
        if version not in (self.current, self.source):
            shutil.rmtree(version, ignore_errors=True)

    def _current_tensors(self, exclude: dict) -> dict[str, torch.Tensor]:
        """The weights the current version holds, except those in ``exclude``."""
        from safetensors import safe_open

        wanted = {n for n in self._canonical_names() if n not in exclude}
        found: dict[str, torch.Tensor] = {}
        for path in sorted(self.current.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in wanted:
                        found[name] = handle.get_tensor(name)
        missing = wanted - set(found)
        if missing:
            raise WeightLoadError(
                "weights",
                f"a partial sync needs the other weights from {self.current}, which lacks "
                f"{sorted(missing)[:3]}; send every weight",
            )
        return found

    def _canonical_names(self) -> list[str]:
        seen: set[int] = set()
        names = []
        for name, target in self._targets.items():
            if id(target) not in seen:
                seen.add(id(target))
                names.append(name)
        return names
