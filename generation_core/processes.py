"""Which processes a run started, read from /proc (Linux): for the watchdog that ends them when
`genrun` is killed (driver/watchdog.py) and for the retry of a Ray start that failed
(serving/ray_setup.py). Standard library only: the watchdog imports this module and starts in
milliseconds.

Three marks find them, because each alone misses some (seen with Ray 2.60):
- the parent links below a process, but only while the parents live: a process whose parent
  dies is re-parented to init (or to a subreaper) at once;
- the run's mark in the environment (`RUN_MARK`), which every process inherits, but Ray's
  DashboardAgent and RuntimeEnvAgent overwrite their environment block when they set their
  process title (/proc shows zeros there);
- the process group, which a re-parented process keeps: Ray's agents are children of the
  raylet, and the raylet dies with the process that started it (its parent-death signal), so
  the agents are left to init, in the group of the `genrun` that started the raylet.
A process is named by its pid and its start time together: a pid is reused once its process
is gone.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

# The environment variable holding a run's mark; `genrun` sets it before starting anything.
RUN_MARK = "GENRUN_RUN_MARK"


@dataclass(frozen=True)
class ProcessEntry:
    """One running process: its parent, its process group and when it started (clock ticks
    after boot, /proc/PID/stat field 22)."""

    ppid: int
    pgid: int
    started: int


def read_process(pid: int) -> ProcessEntry | None:
    """The process `pid`, or None when it is gone or a zombie (it has ended; only its exit
    status waits for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
        # After the command's closing parenthesis (a command may hold one): state, ppid, pgrp, ...
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):
            return None
        return ProcessEntry(ppid=int(fields[1]), pgid=int(fields[2]), started=int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def process_table() -> dict[int, ProcessEntry]:
    """Every running process of the machine (those /proc shows; none where there is no /proc)."""
    table: dict[int, ProcessEntry] = {}
    if not os.path.isdir("/proc"):
        return table
    for name in os.listdir("/proc"):
        if name.isdigit():
            entry = read_process(int(name))
            if entry is not None:
                table[int(name)] = entry
    return table


def descendants(table: dict[int, ProcessEntry], roots: Iterable[int]) -> set[int]:
    """Every process below `roots` by the parent links of `table` (the roots not included)."""
    children: dict[int, list[int]] = {}
    for pid, entry in table.items():
        children.setdefault(entry.ppid, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def left_in_group(table: dict[int, ProcessEntry], pgid: int, started_since: int) -> set[int]:
    """The processes of group `pgid`, started at or after `started_since`, whose parent is not in
    that group: what the group's processes started and then left to init or a subreaper when
    they died. (A shell puts each job in a group of its own, so a job started later by the same
    shell is never one of them.)"""
    return {
        pid
        for pid, entry in table.items()
        if entry.pgid == pgid
        and entry.started >= started_since
        and (entry.ppid not in table or table[entry.ppid].pgid != pgid)
    }


def carries_mark(pid: int, mark: str) -> bool:
    """Whether the environment `pid` started with holds RUN_MARK=`mark`."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return f"{RUN_MARK}={mark}".encode() in handle.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def command_line(pid: int) -> bytes:
    """The command line of `pid` as /proc shows it (arguments NUL-separated; a process that sets
    its title shows the title), empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def still_running(pid: int, started: int) -> bool:
    entry = read_process(pid)
    return entry is not None and entry.started == started


def send(processes: dict[int, int], sig: signal.Signals) -> None:
    """Send `sig` to each pid -> start time of `processes` that is still that process."""
    for pid, started in processes.items():
        if still_running(pid, started):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def kill_and_wait(processes: dict[int, int], timeout: float = 5.0) -> dict[int, int]:
    """SIGKILL `processes` (pid -> start time); those still running after `timeout` seconds."""
    send(processes, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    left = dict(processes)
    while left and time.monotonic() < deadline:
        left = {pid: started for pid, started in left.items() if still_running(pid, started)}
        if left:
            time.sleep(0.05)
    return left
