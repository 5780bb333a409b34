"""The script the vLLM process runs: ``python worker.py FD`` with the operator's interpreter.

It imports only the standard library and vLLM (the interpreter is a separate environment that
does not have our package), reads one JSON request per line from the socket ``FD`` and writes one
JSON reply per line: ``{"seq", "result"}``, ``{"seq", "error": {"type", "message"}}`` or, for a
generation stopped part-way, ``{"seq", "stopped": reason}``. Each request carries a sequence
number ``seq``, which its reply repeats; the line ``{"op": "stop", "seq": N, "reason": ...}`` (no
reply) asks request ``N`` to stop. A reader thread takes lines off the socket, so requests and
stops arrive while the engine works.

``generate`` and ``prompt_logprobs`` calls decode together (:class:`Decoding`,
``DECODING_OPS``): a call's requests join the engine's running batch when the call arrives
(``LLMEngine.add_request``), even while other calls decode, the engine steps while any call has
requests left (``step``), and each call is answered when its last request finishes, so a short
call is not held up by a long one. A stop aborts that call's requests between steps
(``abort_request``); a step that raises fails every call decoding with ``"broken": true`` (what
the failed step left in the engine is not known: the job's side fails the job). Every other op
runs alone: it waits for the calls decoding when it arrives to finish (the job already sends
none while generates run).

Prompts arrive as token ids that the sampling job already validated; results go back in the shape
of our sampler's outputs (see ``arctic_platform.engine.sampler``), so the job returns the same
dictionaries whichever engine produced them.

Weight updates read the safetensors files of a model directory the job wrote (see
``staging.py``): ``restart`` builds a new ``LLM`` on that directory, ``reload`` loads the files into
the running engine through vLLM's ``reload_weights`` and then re-packs the CPU kernels of layers
that reload leaves alone (a tied LM head), so every layer computes with the new weights. On CUDA,
``init_transfer`` and ``transfer`` drive vLLM's weight-transfer engine instead (``transfer.py``;
untested on GPU).
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import json
import pickle
import queue
import socket
import sys
import threading
import traceback
from collections.abc import Callable


class Worker:
    """Holds the ``LLM`` and runs the job's ops on it."""

    def __init__(self) -> None:
        self.llm = None
        self.model = None
        self.engine_args: dict = {}
        self._stops: dict[int, str] = {}  # seq -> why it was asked to stop

    def stop(self, seq: int, reason: str) -> None:
        """Called by the reader thread: request ``seq`` stops at its next decode step."""
        self._stops[seq] = reason

    def stop_reason(self, seq: int) -> str | None:
        return self._stops.get(seq)

    def forget(self, seq: int) -> None:
        """Request ``seq`` was answered: a stop for it no longer matters."""
        self._stops.pop(seq, None)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, model: str, engine_args: dict, optional: list[str] | None = None) -> dict:
        """Build the engine; ``optional`` names arguments to drop (and list under
        ``dropped_engine_args``) where this vLLM lacks them, instead of refusing them."""
        from vllm.engine.arg_utils import EngineArgs

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        args, dropped = known_engine_args(engine_args, known, optional or [])
        self.model, self.engine_args = model, args
        self._build()
        return {**self.describe(), "dropped_engine_args": dropped}

    def describe(self) -> dict:
        import vllm
        from vllm.platforms import current_platform

        parallel = self.llm.llm_engine.vllm_config.parallel_config
        return {
            "vllm_version": vllm.__version__,
            "device": current_platform.device_type,
            "python": sys.executable,
            "workers": parallel.world_size * parallel.data_parallel_size,
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

    def reload(self, model: str) -> dict:
        """Load the weights of ``model`` (the staged directory) into the running engine."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
        repacked = sum(self.llm.apply_model(_repack_cpu_gemms))
        self.llm.reset_prefix_cache()
        self.model = model
        return {"method": "reload", "repacked_layers": repacked}

    def init_transfer(self, init_info: dict) -> dict:
        """Join the job's weight transfer (vLLM's ``init_weight_transfer_engine``)."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        return {"initialized": True}

    def transfer(self, update_info: dict) -> dict:
        """One complete weight update through vLLM's weight-transfer engine. IPC handles come
        pickled (they hold torch types); the job's own process pickled them."""
        pickled = update_info.pop("ipc_handles_pickled", None)
        if pickled is not None:
            update_info["ipc_handles"] = pickle.loads(base64.b64decode(pickled))
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": update_info})
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        return {"method": self.llm.llm_engine.vllm_config.weight_transfer_config.backend}

    def sleep(self, level: int) -> dict:
        self.llm.sleep(level=level)
        return {"level": level}

    def wake(self, tags: list[str] | None) -> dict:
        self.llm.wake_up(tags=tags)
        return {"woke": tags}

    def reset_prefix_cache(self) -> dict:
        return {"reset": bool(self.llm.reset_prefix_cache())}


class Decoding:
    """The calls decoding together in the engine (see module doc): ``add`` a call's requests,
    ``advance`` the engine a step at a time and collect the answers of the calls that ended."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.calls: dict[int, _Call] = {}  # seq -> the call
        self._call_of: dict[str, int] = {}  # engine request id -> seq

    def add(self, seq: int, op: str, args: dict) -> None:
        """Put the requests of decoding op ``op`` (``DECODING_OPS``) into the running batch."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        requests, answer = DECODING_OPS[op](**args)
        engine = self.worker.llm.llm_engine
        ids: list[str] = []
        try:
            for index, request in enumerate(requests):
                params = SamplingParams(**request["params"])
                params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks
                ids.append(f"{seq}-{index}")
                prompt = {"prompt_token_ids": request["prompt_token_ids"]}
                engine.add_request(ids[-1], prompt, params)
        except BaseException:
            engine.abort_request(ids, internal=False)
            raise
        self.calls[seq] = _Call(ids, answer)
        self._call_of.update(dict.fromkeys(ids, seq))

    def advance(self) -> list[tuple[int, dict]]:
        """Stop the calls asked to, step the engine once, and return the reply of each call that
        ended: its answer, its stop, or, when the step raised, an error for every call that marks
        the engine broken (what a failed step left in it is not known)."""
        ended: list[tuple[int, dict]] = []
        for seq in list(self.calls):
            if (reason := self.worker.stop_reason(seq)) is not None:
                self._end(seq)
                ended.append((seq, {"stopped": reason}))
        if not self.calls:
            return ended
        try:
            outputs = self.worker.llm.llm_engine.step()
        except Exception as exc:
            for seq in list(self.calls):
                self._end(seq)
                ended.append((seq, _failure(exc, broken=True)))
            return ended
        for output in outputs:
            seq = self._call_of.pop(output.request_id, None) if output.finished else None
            if seq is not None:
                self.calls[seq].done[output.request_id] = output
        for seq, call in list(self.calls.items()):
            if len(call.done) == len(call.ids):
                self._end(seq)
                try:
                    ended.append((seq, {"result": call.answer([call.done[i] for i in call.ids])}))
                except Exception as exc:  # this call's answer alone
                    ended.append((seq, _failure(exc)))
        return ended

    def _end(self, seq: int) -> None:
        """Drop the call, aborting what it has left in the engine."""
        call = self.calls.pop(seq)
        left = [i for i in call.ids if i not in call.done]
        for request_id in left:
            self._call_of.pop(request_id, None)
        if left:
            self.worker.llm.llm_engine.abort_request(left, internal=False)
        self.worker.forget(seq)


@dataclasses.dataclass
class _Call:
    ids: list[str]  # its requests' ids in the engine, in order
    answer: Callable[[list], object]  # its reply's result, from their final outputs in order
    done: dict = dataclasses.field(default_factory=dict)  # request id -> final output


def _generate(requests: list[dict]):
    """``generate``: one list of sample outputs per request (``prompt_token_ids``,
    ``params``), in the shape of our sampler's."""

    def answer(outputs: list) -> list[list[dict]]:
        return [
            [
                {**_sample(c, r["params"].get("logprobs")), "cached_prompt_tokens": _cached(o)}
                for c in sorted(o.outputs, key=_index)
            ]
            for o, r in zip(outputs, requests, strict=True)
        ]

    return requests, answer


def _prompt_logprobs(prompt_token_ids: list[int]):
    """``prompt_logprobs``: each prompt token's log-prob given the tokens before it (None for the
    first): vLLM's ``prompt_logprobs`` of a one-token request at temperature 1 (the raw
    distribution)."""
    params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}

    def answer(outputs: list) -> list[float | None]:
        (output,) = outputs
        return [
            None if position is None else float(position[token].logprob)
            for token, position in zip(prompt_token_ids, output.prompt_logprobs, strict=True)
        ]

    return [{"prompt_token_ids": prompt_token_ids, "params": params}], answer


# The ops whose requests decode in the running batch: op -> its requests and how its answer is
# read from their outputs.
DECODING_OPS = {"generate": _generate, "prompt_logprobs": _prompt_logprobs}


def known_engine_args(
    engine_args: dict, known: set[str], optional: list[str]
) -> tuple[dict, list[str]]:
    """``engine_args`` without the ones this vLLM lacks (not in ``known``), and those dropped: an
    unknown one is refused, naming it, unless ``optional`` names it (the job set it, not the user,
    and has a path without it)."""
    unknown = sorted(k for k in engine_args if k not in known)
    refused = [k for k in unknown if k not in optional]
    if refused:
        raise ValueError(
            f"vllm_config.{refused[0]}: not an engine argument of this vLLM (unknown: {refused})"
        )
    return {k: v for k, v in engine_args.items() if k in known}, unknown


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


def _cached(output) -> int:
    """The prompt tokens vLLM's prefix cache provided (it counts whole blocks)."""
    return int(getattr(output, "num_cached_tokens", None) or 0)


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
    decoding = Decoding(worker)
    requests: queue.Queue = queue.Queue()

    def read() -> None:
        """Queue requests in order; apply stops at once (they get no reply)."""
        for line in reader:
            request = json.loads(line)
            if request["op"] == "stop":
                worker.stop(request["seq"], request.get("reason", "stopped"))
            else:
                requests.put(request)
        requests.put(None)  # the job closed the socket

    def reply(seq: int, answer: dict) -> None:
        writer.write(json.dumps({"seq": seq, **answer}).encode() + b"\n")
        writer.flush()

    def advance() -> None:
        for seq, answer in decoding.advance():
            reply(seq, answer)

    threading.Thread(target=read, name="requests", daemon=True).start()
    while True:
        try:  # wait for work only when nothing decodes
            request = requests.get(block=not decoding.calls)
        except queue.Empty:
            advance()
            continue
        if request is None:
            break
        op, seq = request["op"], request.get("seq", -1)
        if op in DECODING_OPS:  # joins the calls decoding; the next step takes it in
            try:
                decoding.add(seq, op, request.get("args", {}))
            except Exception as exc:
                reply(seq, _failure(exc))
            continue
        while decoding.calls:  # any other op runs alone
            advance()
        try:
            answer = {"result": getattr(worker, op)(**request.get("args", {}))}
        except Exception as exc:
            answer = _failure(exc)
        worker.forget(seq)
        reply(seq, answer)
        if op == "shutdown":
            return
    worker.shutdown()


def _failure(exc: BaseException, *, broken: bool = False) -> dict:
    """The reply of an op that raised (its traceback goes to the worker's log); ``broken``: the
    engine cannot be trusted with another op (the job's side fails the job)."""
    traceback.print_exception(exc)
    return {"error": {"type": type(exc).__name__, "message": str(exc), "broken": broken}}


if __name__ == "__main__":
    serve(int(sys.argv[1]))
