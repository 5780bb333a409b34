"""The vLLM worker process: started from the operator's interpreter, supervised, talked to.

The channel is a Unix socket pair: the child gets one end as an inherited file descriptor, and
every message either way is one JSON object on one line. Each request carries a sequence number
that its reply repeats, so several threads may call at once (generates that decode together in
the worker, see ``worker.py``): a reader thread hands each reply to the call waiting for it.

Stopping: while it waits for its reply a call looks at the cancel tokens of the op it runs
(:mod:`arctic_platform.engine.cancellation`); once one is set it sends a ``stop`` line for its
request (which gets no reply), and a ``{"stopped": reason}`` reply raises
:class:`~arctic_platform.engine.cancellation.OpCancelled`.

Supervision: while waiting a call also watches the process, so a worker that dies (killed, out of
memory, crashed in native code) raises :class:`VllmWorkerDied` with its exit status and the tail
of its log instead of hanging the job. The worker runs in its own session and
the whole process group is killed on close, so processes vLLM started itself go with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arctic_platform.engine import cancellation
from arctic_platform.engine.errors import EngineBroken

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
_POLL_S = 0.1  # how often a wait for a reply checks the process and the op's cancel tokens
_LOG_TAIL_BYTES = 4000


class VllmWorkerDied(EngineBroken):
    """The vLLM process is gone; the sampling job cannot continue."""


class VllmWorkerError(RuntimeError):
    """The vLLM process raised while running an op (its type and message are kept)."""

    def __init__(self, op: str, kind: str, message: str) -> None:
        super().__init__(f"vLLM worker: {op} raised {kind}: {message}")
        self.kind = kind
        self.message = message


class VllmEngineBroken(VllmWorkerError, EngineBroken):
    """vLLM's engine failed a decode step: the process lives, but what the failed step left in
    the engine is not known, so the sampling job cannot continue (the Service fails it)."""


class WorkerProcess:
    """One running worker script and the socket to it."""

    def __init__(self, python: str, *, env: Mapping[str, str], log_path: Path) -> None:
        self.log_path = log_path
        ours, theirs = socket.socketpair()
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [python, str(WORKER_SCRIPT), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
        theirs.close()
        self._sock = ours
        self._sending = threading.Lock()
        self._replies = _Replies()
        threading.Thread(target=self._read, name="vllm-replies", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        """Send ``op`` with ``args`` and wait for its result (``timeout`` seconds, or forever
        while the process lives); other threads may call meanwhile."""
        seq, reply = self._replies.expect()
        try:
            try:
                self._send({"op": op, "args": args, "seq": seq})
            except OSError:
                raise self._died(op) from None
            answer = self._wait(op, seq, reply, timeout)
        finally:
            self._replies.drop(seq)
        if "stopped" in answer:
            raise cancellation.OpCancelled(answer["stopped"])
        if "error" in answer:
            error = answer["error"]
            failure = VllmEngineBroken if error.get("broken") else VllmWorkerError
            raise failure(op, error["type"], error["message"])
        return answer["result"]

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit, then make sure its whole process group is gone."""
        if self.alive():
            with contextlib.suppress(VllmWorkerDied, VllmWorkerError, TimeoutError):
                self.call("shutdown", timeout=timeout)
        self._kill_group()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # ends the reader thread's wait
        self._sock.close()

    def _send(self, message: dict) -> None:
        with self._sending:
            self._sock.sendall(json.dumps(message).encode() + b"\n")

    def _wait(self, op: str, seq: int, reply: _Reply, timeout: float | None) -> dict:
        """The reply to request ``seq``, sending its stop when its op is cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stop_sent = False
        while not reply.arrived.wait(_POLL_S):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"vLLM worker: no reply to {op} within {timeout:.0f} s")
            reason = None if stop_sent else cancellation.requested()
            if reason is not None:
                with contextlib.suppress(OSError):  # a dead worker is reported below
                    self._send({"op": "stop", "seq": seq, "reason": reason})
                stop_sent = True
            if self._replies.closed or not self.alive():
                raise self._died(op)
        if not reply.answer:  # woken because the socket closed: no reply will come
            raise self._died(op)
        return reply.answer

    def _read(self) -> None:
        """The reader thread: each reply line to the call that waits for it, until the socket
        closes (the worker died or the job closed it)."""
        buffer = bytearray()
        try:
            while data := self._sock.recv(1 << 20):
                buffer += data
                *lines, rest = buffer.split(b"\n")
                buffer = bytearray(rest)
                for line in lines:
                    answer = json.loads(line)
                    self._replies.deliver(answer.pop("seq"), answer)
        except OSError:  # reset by a worker that died, or closed by ``close``
            pass
        finally:
            self._replies.close()

    def _died(self, op: str) -> VllmWorkerDied:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # the socket closed but the process lingers
            self._kill_group()
            code = self._proc.wait()
        self._kill_group()  # processes vLLM started die with it
        status = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return VllmWorkerDied(
            f"the vLLM worker process (pid {self.pid}) died during {op} ({status}); "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                return log.read().decode(errors="replace").strip()
        except OSError:
            return "(no log)"

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)


@dataclass
class _Reply:
    arrived: threading.Event = field(default_factory=threading.Event)
    answer: dict = field(default_factory=dict)


class _Replies:
    """The calls waiting for replies, by sequence number (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._waiting: dict[int, _Reply] = {}
        self.closed = False

    def expect(self) -> tuple[int, _Reply]:
        """A new sequence number and where its reply will arrive."""
        with self._lock:
            self._seq += 1
            reply = self._waiting[self._seq] = _Reply()
            return self._seq, reply

    def deliver(self, seq: int, answer: dict) -> None:
        with self._lock:
            reply = self._waiting.get(seq)  # None: its call timed out and left
        if reply is not None:
            reply.answer = answer
            reply.arrived.set()

    def drop(self, seq: int) -> None:
        with self._lock:
            self._waiting.pop(seq, None)

    def close(self) -> None:
        """No reply will come any more: wake every waiting call (it finds the worker dead)."""
        self.closed = True
        with self._lock:
            waiting = list(self._waiting.values())
        for reply in waiting:
            reply.arrived.set()
