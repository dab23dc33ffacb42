"""What `genrun` starts ends with it, however it ends.

A run starts helpers that outlive a process killed with kill -9 (or by the OOM killer): the
temporary Prefect server (flows/prefect_api.py: Prefect starts it, so it cannot be given a
parent-death signal) and parts of the local Ray that `ray.init` starts (its GCS and raylet have
a parent-death signal and its workers exit with their raylet, but the raylet's DashboardAgent
and RuntimeEnvAgent, left to init, run on for about a minute: they try to report the raylet's
death to the GCS, which is gone too).

`Watchdog.start()` marks this process's environment (`processes.RUN_MARK`, inherited by all it
starts) and starts a small watchdog process (`watch`: standard library only, it starts in
milliseconds) in a session of its own (a terminal's Ctrl-C does not reach it). While this process
runs, the watchdog notes the processes below it once a second. Once it is gone without having
stopped the watchdog (`stop`), the watchdog looks every 0.1 s for what it started, by the three
marks of generation_core/processes.py (noted below it, carrying the mark, or left by it in its
process group), so a process started after the last note is found as well: SIGTERM at first
sight, SIGKILL to any left 3 s after this process was gone, until a look finds none. Linux only
(elsewhere `start` starts nothing; the helpers' own shutdown is all there is).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from generation_core.processes import (
    RUN_MARK,
    ProcessEntry,
    carries_mark,
    descendants,
    left_in_group,
    process_table,
    read_process,
    send,
)

NOTE_SECONDS = 1.0
PARENT_POLL_SECONDS = 0.1
# SIGTERM first (the Prefect server closes its database), SIGKILL to what is left after this:
# nothing outlives the run by more than about this long.
TERM_GRACE_SECONDS = 3.0
# A look that finds nothing is repeated this many times (0.1 s apart) before the watchdog exits.
QUIET_LOOKS = 3
GIVE_UP_SECONDS = 30.0

WATCH = "import sys; from generation_core.driver.watchdog import watch; watch(int(sys.argv[1]), sys.argv[2])"


def watch(watched: int, mark: str) -> None:
    """The watchdog process's body: wait for `watched` (this process's parent) to be gone, then
    end what it started."""
    me, watched_entry, own_entry = os.getpid(), read_process(watched), read_process(os.getpid())
    if watched_entry is None or own_entry is None or os.getppid() != watched:
        return
    # Watching now: `Watchdog.start` waits for this line, so nothing the run starts comes before it.
    sys.stdout.write("watching\n")
    sys.stdout.flush()
    noted: dict[int, int] = {}
    next_note = 0.0
    while os.getppid() == watched:
        if time.monotonic() >= next_note:
            table = process_table()
            noted.update({pid: table[pid].started for pid in descendants(table, [watched]) if pid != me})
            next_note = time.monotonic() + NOTE_SECONDS
        time.sleep(PARENT_POLL_SECONDS)
    _end_what_it_started(noted, mark, group=watched_entry.pgid, since=own_entry.started)


def _what_it_started(
    table: dict[int, ProcessEntry], noted: dict[int, int], mark: str, group: int, since: int
) -> dict[int, int]:
    """pid -> start time of every running process the watched process started, by any mark.
    `since`: the watchdog's own start (everything the run started came after it)."""
    found = {pid for pid, started in noted.items() if pid in table and table[pid].started == started}
    found |= left_in_group(table, group, since)
    found |= {pid for pid in table if carries_mark(pid, mark)}
    found |= descendants(table, found)
    found.discard(os.getpid())
    return {pid: table[pid].started for pid in found}


def _end_what_it_started(noted: dict[int, int], mark: str, group: int, since: int) -> None:
    gone_at = time.monotonic()
    quiet = 0
    termed: set[tuple[int, int]] = set()
    while quiet < QUIET_LOOKS and time.monotonic() - gone_at < GIVE_UP_SECONDS:
        running = _what_it_started(process_table(), noted, mark, group, since)
        quiet = 0 if running else quiet + 1
        if time.monotonic() - gone_at >= TERM_GRACE_SECONDS:
            send(running, signal.SIGKILL)
        else:
            send({pid: started for pid, started in running.items() if (pid, started) not in termed}, signal.SIGTERM)
            termed.update(running.items())
        time.sleep(PARENT_POLL_SECONDS)


class Watchdog:
    """The watchdog of this process's helpers: `start` before starting them, `stop` once they are stopped."""

    def __init__(self, process: subprocess.Popen | None, previous_mark: str | None = None):
        self._process = process
        self._previous_mark = previous_mark

    @classmethod
    def start(cls) -> Watchdog:
        if not sys.platform.startswith("linux"):
            return cls(None)
        mark = f"{os.getpid()}-{time.time_ns()}"
        # The watchdog itself carries no mark of this run (a watchdog of an enclosing run may end it).
        environment = {name: value for name, value in os.environ.items() if name != RUN_MARK}
        process = subprocess.Popen(
            [sys.executable, "-c", WATCH, str(os.getpid()), mark],
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # Wait until it watches: a kill -9 right after this (the temporary Prefect server launches
        # next) must find a watchdog already watching, not one still importing.
        assert process.stdout is not None
        process.stdout.readline()
        process.stdout.close()
        previous = os.environ.get(RUN_MARK)
        os.environ[RUN_MARK] = mark
        return cls(process, previous)

    def stop(self) -> None:
        """This process stopped its helpers itself: nothing left to watch."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
            if self._previous_mark is None:
                os.environ.pop(RUN_MARK, None)
            else:
                os.environ[RUN_MARK] = self._previous_mark
