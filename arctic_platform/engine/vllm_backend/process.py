"""The vLLM worker process: started from the operator's interpreter, supervised, talked to.

The channel is a Unix socket pair: the child gets one end as an inherited file descriptor, and
every message either way is one JSON object on one line. Calls are strictly one at a time (a
sampling sub-job runs its ops in order), so a reply always belongs to the last request.

Stopping: each request carries a sequence number. While it waits for a reply the parent looks at
the cancel tokens of the op it runs (:mod:`arctic_platform.engine.cancellation`); once one is set
it sends a ``stop`` line for that request (which gets no reply), and a ``{"stopped": reason}``
reply raises :class:`~arctic_platform.engine.cancellation.OpCancelled`.

Supervision: while waiting for a reply the parent also watches the process, so a worker that dies
(killed, out of memory, crashed in native code) raises :class:`VllmWorkerDied` with its exit
status and the tail of its log instead of hanging the job. The worker runs in its own session and
the whole process group is killed on close, so processes vLLM started itself go with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
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
        self._buffer = bytearray()
        self._seq = 0

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        """Send ``op`` with ``args`` and wait for its result (``timeout`` seconds, or forever
        while the process lives)."""
        self._seq += 1
        try:
            self._send({"op": op, "args": args, "seq": self._seq})
        except OSError:
            raise self._died(op) from None
        reply = json.loads(self._read_line(op, timeout))
        if "stopped" in reply:
            raise cancellation.OpCancelled(reply["stopped"])
        if "error" in reply:
            error = reply["error"]
            raise VllmWorkerError(op, error["type"], error["message"])
        return reply["result"]

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit, then make sure its whole process group is gone."""
        if self.alive():
            with contextlib.suppress(VllmWorkerDied, VllmWorkerError, TimeoutError):
                self.call("shutdown", timeout=timeout)
        self._kill_group()
        self._sock.close()

    def _send(self, message: dict) -> None:
        self._sock.sendall(json.dumps(message).encode() + b"\n")

    def _read_line(self, op: str, timeout: float | None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        stop_sent = False
        while b"\n" not in self._buffer:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"vLLM worker: no reply to {op} within {timeout:.0f} s")
            reason = None if stop_sent else cancellation.requested()
            if reason is not None:
                with contextlib.suppress(OSError):  # a dead worker is reported below
                    self._send({"op": "stop", "seq": self._seq, "reason": reason})
                stop_sent = True
            ready, _, _ = select.select([self._sock], [], [], _POLL_S)
            if not ready:
                if not self.alive():
                    raise self._died(op)
                continue
            try:
                data = self._sock.recv(1 << 20)
            except OSError:  # reset by a peer that died with our request unread
                data = b""
            if not data:
                raise self._died(op)
            self._buffer += data
        line, _, rest = self._buffer.partition(b"\n")
        self._buffer = bytearray(rest)
        return bytes(line)

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
