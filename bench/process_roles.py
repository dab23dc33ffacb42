"""The processes of a `genrun` run by role, read from /proc: the driver (the command itself), each
Ray worker by the task or actor its process title names (`ray::run_shard`: the shard worker), Ray's
daemons, the Prefect server. `follow` polls them while the run goes and keeps, per process, its CPU
time, its main thread's running-or-waiting time and its peak resident memory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Ray's process titles (`ray::Name`, `ray::Name.method`, `ray::actor_name:Class.method`) -> role.
RAY_ROLES = {
    "run_shard": "shard worker",
    "EngineServer": "server actor",
    "ServerRegistry": "server registry",
    "ProgressBoard": "progress board",
    "DashboardAgent": "ray daemons",
    "RuntimeEnvAgent": "ray daemons",
    "IDLE": "idle ray workers",
}
DAEMON_MARKS = ("gcs_server", "raylet", "dashboard.py", "monitor.py", "log_monitor.py", "ray/_private", "ray/dashboard")


@dataclass
class Process:
    pid: int
    titles: list[str] = field(default_factory=list)
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    """(unix time, CPU seconds so far, seconds its main thread was running or waiting for a core so far)."""
    peak_rss: int = 0

    def at(self, moment: float, column: int) -> float:
        """A sample column at `moment`, linear between polls (0 before the first, the last after the last)."""
        if not self.samples or moment < self.samples[0][0]:
            return 0.0
        for before, after in zip(self.samples, self.samples[1:], strict=False):
            if moment <= after[0]:
                share = (moment - before[0]) / (after[0] - before[0])
                return before[column] + (after[column] - before[column]) * share
        return self.samples[-1][column]


def read_stat(pid: int) -> tuple[int, int, int, float, int] | None:
    """(ppid, session, start time in ticks, CPU seconds, resident bytes) of a live or zombie process;
    None once gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, session 6, utime 14, stime 15, starttime 22, rss 24.
    cpu = (int(fields[11]) + int(fields[12])) / TICKS
    return int(fields[1]), int(fields[3]), int(fields[19]), cpu, int(fields[21]) * PAGE_BYTES


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _all_stats() -> dict[int, tuple[int, int, int, float, int]]:
    stats = {int(entry): read_stat(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()}
    return {pid: stat for pid, stat in stats.items() if stat is not None}


class ProcessTree:
    """Every process below `root`, and those once below it that were re-parented since."""

    def __init__(self, root: int):
        self.root = root
        self.processes: dict[tuple[int, int], Process] = {}
        self.exited_at: float | None = None
        """When `root` exited (`follow`)."""

    def poll(self, now: float) -> int:
        """One look at /proc; the number of tracked processes still alive."""
        table = _all_stats()
        tracked = {pid for pid, start in self.processes if table.get(pid, (0, 0, -1))[2] == start} | {self.root}
        below = {pid for pid, stat in table.items() if stat[0] in tracked} - tracked
        while below:
            tracked |= below
            below = {pid for pid, stat in table.items() if stat[0] in below} - tracked
        for pid in tracked & set(table):
            _, _, start, cpu, rss = table[pid]
            process = self.processes.setdefault((pid, start), Process(pid))
            title = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
            if title and (not process.titles or process.titles[-1] != title):
                process.titles.append(title)
            # The main thread's nanoseconds on a core and waiting for one (the last value once gone).
            schedstat = _read(f"/proc/{pid}/schedstat").split()[:2]
            runnable = sum(map(int, schedstat)) / 1e9 if schedstat else (process.samples or [(0, 0, 0.0)])[-1][2]
            process.samples.append((now, cpu, runnable))
            process.peak_rss = max(process.peak_rss, rss)
        return len(tracked & set(table))

    def role_of(self, process: Process) -> str:
        if process.pid == self.root:
            return "driver"
        names = [t[5:].split()[0].split(":")[-1].split(".")[0] for t in process.titles if t.startswith("ray::")]
        busy = [name for name in names if name != "IDLE"] or names
        if busy:
            return RAY_ROLES.get(busy[0], f"ray::{busy[0]}")
        joined = " ".join(process.titles)
        if "prefect.server" in joined or "prefect" in joined and "uvicorn" in joined:
            return "prefect server"
        if "watchdog" in joined:
            return "watchdog"
        if any(mark in joined for mark in DAEMON_MARKS):
            return "ray daemons"
        return f"other: {Path(joined.split()[0]).name if joined else '?'}"

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
) -> ProcessTree:
    """Polls `child` and every process below it until `until()` is true, or `child` has exited and
    the processes it left are gone (or `linger` seconds have passed since)."""
    tree = ProcessTree(child.pid)
    while True:
        now = time.time()
        # Not reaped yet (WNOWAIT): a zombie's /proc stat still holds its final CPU time.
        exited = tree.exited_at is None and os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        alive = tree.poll(now)
        if exited:
            tree.exited_at = now
            child.wait()
        if tree.exited_at is not None and (alive == 0 or now - tree.exited_at >= linger) or until():
            return tree
        time.sleep(poll)


def stop_session(leader: int) -> None:
    """SIGTERM, then SIGKILL, to every process of the session `leader` leads (start_new_session=True)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, stat in _all_stats().items():
            if stat[1] == leader:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        time.sleep(3)
