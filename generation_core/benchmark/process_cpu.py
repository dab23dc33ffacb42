"""The processes of a whole `genrun` run and their CPU time, read from /proc while it runs: every
process below the command (the driver), each named by its role from the title Ray gives its workers
(`ray::run_shard`: the shard worker), its CPU seconds (user + system) sampled every poll, so the CPU
of any span (the generation phase) is interpolated per process. Linux only: where /proc cannot be
read, PROC_READABLE is false and `genrun bench` says its CPU figure is not available.
bench/process_roles.py extends the same tree for the benchmarks (runnable time, a row per role)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROC_READABLE = Path("/proc/self/stat").exists()
TICKS = os.sysconf("SC_CLK_TCK") if PROC_READABLE else 100
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if PROC_READABLE else 4096
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
# genrun's own work. The server actors are left out whole: an engine that computes inside the actor
# (the transformers engine) cannot be told apart from the actor's own work there.
GENRUN_OWN_ROLES = ("driver", "shard worker", "server registry", "progress board")


@dataclass
class Process:
    pid: int
    titles: list[str] = field(default_factory=list)
    samples: list[tuple[float, ...]] = field(default_factory=list)
    """(unix time, CPU seconds so far, then any columns a subclass of ProcessTree adds)."""
    peak_rss: int = 0

    def at(self, moment: float, column: int = 1) -> float:
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


def read_text(path: str) -> str:
    try:
        return Path(path).read_bytes().decode(errors="replace")
    except OSError:
        return ""


def all_stats() -> dict[int, tuple[int, int, int, float, int]]:
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
        table = all_stats()
        tracked = {pid for pid, start in self.processes if table.get(pid, (0, 0, -1))[2] == start} | {self.root}
        below = {pid for pid, stat in table.items() if stat[0] in tracked} - tracked
        while below:
            tracked |= below
            below = {pid for pid, stat in table.items() if stat[0] in below} - tracked
        for pid in tracked & set(table):
            _, _, start, cpu, rss = table[pid]
            process = self.processes.setdefault((pid, start), Process(pid))
            title = read_text(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
            if title and (not process.titles or process.titles[-1] != title):
                process.titles.append(title)
            process.samples.append((now, cpu, *self.more_columns(pid, process)))
            process.peak_rss = max(process.peak_rss, rss)
        return len(tracked & set(table))

    def more_columns(self, pid: int, process: Process) -> tuple[float, ...]:
        """The columns after the CPU seconds in each sample: none here."""
        return ()

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

    def cpu_seconds(self, roles: tuple[str, ...], start: float, end: float) -> float:
        """CPU seconds of the processes of `roles` in [start, end] (unix times)."""
        chosen = [process for process in self.processes.values() if self.role_of(process) in roles]
        return sum(process.at(end) - process.at(start) for process in chosen)


def follow(
    child: subprocess.Popen,
    poll: float,
    *,
    linger: float = 0.0,
    until: Callable[[], bool] = lambda: False,
    tree: ProcessTree | None = None,
) -> ProcessTree:
    """Polls `child` and every process below it (into `tree`, a new ProcessTree if None) until
    `until()` is true, or `child` has exited and the processes it left are gone (or `linger` seconds
    have passed since)."""
    tree = tree or ProcessTree(child.pid)
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
