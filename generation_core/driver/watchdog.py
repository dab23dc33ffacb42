"""What `genrun` starts ends with it, however it ends.

A run starts helpers that outlive a process killed with kill -9 (or by the OOM killer): the
temporary Prefect server (flows/prefect_api.py: Prefect starts it, so it cannot be given a
parent-death signal; seen: orphaned servers, parent pid 1, each holding a port and ~200 MB) and
parts of the local Ray that `ray.init` starts (its GCS and raylet have a parent-death signal and
its workers exit with their raylet, but the raylet's DashboardAgent and RuntimeEnvAgent were
measured running on for ~65 s after a kill -9 of the driver, Ray 2.60).

`Watchdog.start()` starts a small watchdog process (`WATCHDOG`: os, signal, time; it starts in
milliseconds, ~10 MB) in a session of its own (a terminal's Ctrl-C does not reach it). Once a
second it notes every process below this one (from /proc: pid and start time, so a reused pid
is never taken for one of ours). When this process is gone without having stopped it (`stop`),
it sends SIGTERM to those still running, SIGKILL to any left 5 s later, and exits. Linux only
(elsewhere `start` starts nothing; the helpers' own shutdown is all there is).
"""

from __future__ import annotations

import os
import subprocess
import sys

# argv: the pid to watch. Reads /proc/PID/stat: after the command's closing parenthesis, field 3
# (state) on; ppid is field 4, the start time field 22.
WATCHDOG = r"""
import os, signal, sys, time

watched, me = int(sys.argv[1]), os.getpid()


def stat(pid):
    with open(f"/proc/{pid}/stat") as handle:
        text = handle.read()
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[19]


def below(root):
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                table[int(name)] = stat(int(name))
            except (OSError, ValueError, IndexError):
                continue
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child != me:
                found[child] = table[child][1]
                todo.append(child)
    return found


def still_ours(pid, started):
    try:
        return stat(pid)[1] == started
    except (OSError, ValueError, IndexError):
        return False


seen = {}
while os.getppid() == watched:
    if os.path.isdir("/proc"):
        seen = below(watched)
    time.sleep(1.0)
for sig in (signal.SIGTERM, signal.SIGKILL):
    left = [pid for pid, started in seen.items() if still_ours(pid, started)]
    for pid in left:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    for _ in range(50):
        if not any(still_ours(pid, seen[pid]) for pid in left):
            sys.exit(0)
        time.sleep(0.1)
"""


class Watchdog:
    """The watchdog of this process's helpers: `start` before starting them, `stop` once they are stopped."""

    def __init__(self, process: subprocess.Popen | None):
        self._process = process

    @classmethod
    def start(cls) -> Watchdog:
        if not sys.platform.startswith("linux"):
            return cls(None)
        return cls(subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        ))

    def stop(self) -> None:
        """This process stopped its helpers itself: nothing left to watch."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
