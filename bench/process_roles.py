"""The processes of a `genrun` run by role, as genrun bench reads them
(generation_core/benchmark/process_cpu.py: the driver, each Ray worker by the task or actor its
process title names, Ray's daemons, the Prefect server), with what the benchmarks add: per
process, its main thread's running-or-waiting time, and a row per role."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable

from generation_core.benchmark import process_cpu
from generation_core.benchmark.process_cpu import Process, ProcessTree, all_stats, read_text


class RoleTree(ProcessTree):
    """Samples of (unix time, CPU seconds so far, seconds its main thread was running or waiting for
    a core so far)."""

    def more_columns(self, pid: int, process: Process) -> tuple[float, ...]:
        # The main thread's nanoseconds on a core and waiting for one (the last value once gone).
        schedstat = read_text(f"/proc/{pid}/schedstat").split()[:2]
        return (sum(map(int, schedstat)) / 1e9 if schedstat else (process.samples or [(0, 0, 0.0)])[-1][2],)

    def roles(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """role -> processes, `phase` CPU seconds in [start, end], `runnable` main-thread seconds in
        it, `life` CPU seconds, `peak_rss` bytes (its largest process)."""
        out: dict[str, dict[str, float]] = {}
        for process in self.processes.values():
            row = out.setdefault(self.role_of(process), dict.fromkeys(("processes", "phase", "runnable", "life"), 0))
            row["processes"] += 1
            row["phase"] += process.at(end, 1) - process.at(start, 1)
            row["runnable"] += process.at(end, 2) - process.at(start, 2)
            row["life"] += process.samples[-1][1] if process.samples else 0.0
            row["peak_rss"] = max(row.get("peak_rss", 0), process.peak_rss)
        return out


def follow(
    child: subprocess.Popen, poll: float, *, linger: float = 0.0, until: Callable[[], bool] = lambda: False
) -> RoleTree:
    """process_cpu.follow into a RoleTree."""
    tree = RoleTree(child.pid)
    process_cpu.follow(child, poll, linger=linger, until=until, tree=tree)
    return tree


def stop_session(leader: int) -> None:
    """SIGTERM, then SIGKILL, to every process of the session `leader` leads (start_new_session=True)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, stat in all_stats().items():
            if stat[1] == leader:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        time.sleep(3)
