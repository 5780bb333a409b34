"""Stop a launched server when the process that launched it is gone.

A framework driver that starts ``arctic-platform serve`` through ``launch_local_server`` may never
call ``shutdown()`` (SkyRL does not), and may die by SIGKILL, which runs no cleanup at all. The
launcher passes its pid (``serve --parent-pid``); a daemon thread here checks every
``interval`` seconds whether this process still has that parent (once the parent dies the kernel
re-parents us, so ``getppid()`` changes) and then sends this process SIGTERM, which stops the
server the normal way: the op in flight finishes, then it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("arctic_platform.serve")


def watch_parent(parent_pid: int, *, interval: float = 0.5) -> threading.Thread:
    """Start the watchdog thread for ``parent_pid`` (see module doc) and return it."""

    def run() -> None:
        stop = threading.Event()
        while not stop.wait(interval):
            if os.getppid() != parent_pid:
                log.warning("parent process %d is gone: stopping the server", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    if os.getppid() != parent_pid:
        raise SystemExit(f"--parent-pid {parent_pid}: this server's parent is {os.getppid()}")
    thread = threading.Thread(target=run, name="parent-watch", daemon=True)
    thread.start()
    return thread
