"""Ctrl-C as a normal way to stop a run.

The first SIGINT asks the run to stop (`STOP.requested()`): the flow stops dispatching, its
shard jobs commit what has finished, the run's lease is released, Ray and the temporary Prefect
server stop, and `genrun` says how many trajectories are committed and exits 130. A second
SIGINT exits at once (130): what is committed stays committed; the lease stays behind, and the
next run on this machine takes it over at once (its holder is gone). Every process genrun started,
and theirs (Ray's GCS, raylet and its agents and workers, the Prefect server), is killed on the
way out: left alone, Ray's agents notice their raylet is gone only after tens of seconds on a
loaded machine.

Stages with nothing of their own to commit (waiting for a dying lease, booting replicas, merging,
publishing) run inside `STOP.interruptible()`: there the first SIGINT (or one that came before)
raises `Stopped` in the main thread at once, and the run ends as after any first Ctrl-C (what is
committed stays, the lease is released, exit 130, the same command resumes).

A terminal sends SIGINT to its whole foreground process group. Ray starts its processes with
SIGINT blocked; the helpers genrun starts itself (the temporary Prefect server) are started
with it blocked too (`sigint_blocked`), so they keep serving while the run winds down and are
stopped by genrun in order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from generation_core.processes import descendants, process_table

FIRST_MESSAGE = (
    "genrun: stopping: committing the trajectories that have finished, then releasing the output folder "
    "(Ctrl-C again to quit at once)"
)
SECOND_MESSAGE = "genrun: stopped at once; committed trajectories are kept, run the same command again to resume"


class Stopped(KeyboardInterrupt):
    """A first Ctrl-C during an interruptible stage (`StopRequest.interruptible`): the stage ends
    at once. A KeyboardInterrupt, so code that cleans up on one (Ray, asyncio) does so here too."""


class StopRequest:
    """The process's Ctrl-C state: `install` in the main thread, `requested` anywhere."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._hard_exit: list[Callable[[], None]] = []
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None  # what signal.signal returned
        self._installed = False
        # How deep the main thread is in interruptible stages (only it receives signals).
        self._interruptible = 0

    def install(self) -> None:
        if not self._installed:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """SIGINT handled as above for the block: a library caller's run (dispatch.run_in_process)
        stops on a Ctrl-C as `genrun`'s does. Where something installed it already (the CLI) or
        this is not the main thread (only it receives signals), the block changes nothing. A stop
        requested during the block is forgotten after it: the caller's next run starts afresh."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            yield
            return
        self.install()
        try:
            yield
        finally:
            self.uninstall()
            self._event.clear()

    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def on_hard_exit(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` (fast, no waiting) before a second Ctrl-C exits; returns its remover."""
        self._hard_exit.append(callback)
        return lambda: self._hard_exit.remove(callback) if callback in self._hard_exit else None

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A stage that a first Ctrl-C ends at once (raising `Stopped`) rather than asking it to
        stop at its next commit: one that waits, boots or merges, and commits nothing that a
        stop could keep. Raises `Stopped` on entry when a Ctrl-C came already. In a thread other
        than the main one it only does that check: a signal handler cannot raise there."""
        if self.requested():
            raise Stopped()
        main = threading.current_thread() is threading.main_thread()
        self._interruptible += main
        try:
            yield
        finally:
            self._interruptible -= main

    def request(self) -> None:
        """What the first Ctrl-C does, for callers that stop a run by other means."""
        self._event.set()

    def _handle(self, signum, frame) -> None:
        if not self._event.is_set():
            self._event.set()
            _say(FIRST_MESSAGE)
            if self._interruptible:
                raise Stopped()
            return
        _say(SECOND_MESSAGE)
        for callback in list(self._hard_exit):
            try:
                callback()
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        kill_descendants()
        os._exit(130)


def kill_descendants() -> list[int]:
    """SIGKILL every process this one started, and theirs, found through /proc (nothing where
    there is no /proc); answers their pids. For quitting at once: nothing waits."""
    found = sorted(descendants(process_table(), [os.getpid()]))
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return found


def _say(message: str) -> None:
    # os.write: safe inside a signal handler, whatever the main thread was writing.
    prefix = "\r\x1b[K" if os.isatty(2) else ""
    os.write(2, f"{prefix}{message}\n".encode())


STOP = StopRequest()


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread, so processes started from it ignore the terminal's Ctrl-C
    (a blocked signal stays blocked across exec). Use in a thread of its own: the main thread
    must keep receiving SIGINT."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
