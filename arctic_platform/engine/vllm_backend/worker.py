"""The script the vLLM process runs: ``python worker.py FD`` with the operator's interpreter.

It imports only the standard library and vLLM (the interpreter is a separate environment that
does not have our package), reads one JSON request per line from the socket ``FD`` and writes one
JSON reply per line: ``{"result": ...}`` or ``{"error": {"type", "message"}}``. Prompts arrive as
token ids that the sampling job already validated; results go back in the shape of our sampler's
outputs (see ``arctic_platform.engine.sampler``), so the job returns the same dictionaries
whichever engine produced them.

Weight updates read the safetensors files of a model directory the job wrote (see
``staging.py``): ``restart`` builds a new ``LLM`` on that directory, ``reload`` loads the files into
the running engine through vLLM's ``reload_weights`` and then re-packs the CPU kernels of layers
that reload leaves alone (a tied LM head), so every layer computes with the new weights.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import socket
import sys
import traceback


class Worker:
    """Holds the ``LLM`` and runs the job's ops on it."""

    def __init__(self) -> None:
        self.llm = None
        self.model = None
        self.engine_args: dict = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, model: str, engine_args: dict) -> dict:
        from vllm.engine.arg_utils import EngineArgs

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(k for k in engine_args if k not in known)
        if unknown:
            raise ValueError(
                f"vllm_config.{unknown[0]}: not an engine argument of this vLLM "
                f"(unknown: {unknown})"
            )
        self.model, self.engine_args = model, dict(engine_args)
        self._build()
        return self.describe()

    def describe(self) -> dict:
        import vllm
        from vllm.platforms import current_platform

        return {
            "vllm_version": vllm.__version__,
            "device": current_platform.device_type,
            "python": sys.executable,
        }

    def _build(self) -> None:
        from vllm import LLM

        self.llm = LLM(model=self.model, **self.engine_args)

    def restart(self, model: str) -> dict:
        """A fresh engine on ``model`` (the staged directory), same engine arguments."""
        self._drop()
        self.model = model
        self._build()
        return {"method": "restart"}

    def _drop(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm
        gc.collect()

    def shutdown(self) -> dict:
        self._drop()
        return {"stopped": True}

    # -- ops -------------------------------------------------------------------------------

    def generate(self, requests: list[dict]) -> list[list[dict]]:
        """One list of sample outputs per request (``prompt_token_ids``, ``params``)."""
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
        params = [SamplingParams(**r["params"]) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            [_sample(c, r["params"].get("logprobs")) for c in sorted(o.outputs, key=_index)]
            for o, r in zip(outputs, requests, strict=True)
        ]

    def reload(self, model: str) -> dict:
        """Load the weights of ``model`` (the staged directory) into the running engine."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
        repacked = sum(self.llm.apply_model(_repack_cpu_gemms))
        self.llm.reset_prefix_cache()
        self.model = model
        return {"method": "reload", "repacked_layers": repacked}

    def sleep(self, level: int) -> dict:
        self.llm.sleep(level=level)
        return {"level": level}

    def wake(self, tags: list[str] | None) -> dict:
        self.llm.wake_up(tags=tags)
        return {"woke": tags}

    def reset_prefix_cache(self) -> dict:
        return {"reset": bool(self.llm.reset_prefix_cache())}


def _repack_cpu_gemms(model) -> int:
    """Re-pack the CPU GEMM kernels of layers that keep their weight (the embedding and a tied
    LM head): vLLM's reload re-processes the layers it loaded, but the LM head tied to the
    embedding is not loaded itself and would keep computing logits with the old weights."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


def _index(completion) -> int:
    return completion.index


def _sample(completion, k: int | None) -> dict:
    out = {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "sample_index": completion.index,
    }
    if k is not None:
        out["logprobs"] = [
            {
                "token_id": token,
                "logprob": float(position[token].logprob),
                "top": [
                    [int(t), float(p.logprob)]
                    for t, p in sorted(position.items(), key=lambda item: item[1].rank)
                    if p.rank is not None and p.rank <= k
                ][:k],
            }
            for token, position in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
    return out


def serve(fd: int) -> None:
    """Answer requests on socket ``fd`` until ``shutdown`` or until the job closes the socket."""
    sock = socket.socket(fileno=fd)
    reader, writer = sock.makefile("rb"), sock.makefile("wb")
    worker = Worker()
    for line in reader:
        request = json.loads(line)
        op = request["op"]
        try:
            reply = {"result": getattr(worker, op)(**request.get("args", {}))}
        except Exception as exc:
            traceback.print_exc()
            reply = {"error": {"type": type(exc).__name__, "message": str(exc)}}
        writer.write(json.dumps(reply).encode() + b"\n")
        writer.flush()
        if op == "shutdown":
            return
    worker.shutdown()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
