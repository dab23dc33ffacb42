"""Instrumentation for benchmarks, debugging and the chaos suite; all of it off unless asked for
through the environment, which every process of a run inherits (the CLI, the flow, Ray workers).

Timeline (`GENRUN_TIMELINE=<file>`): `mark(event)` appends `<event> pid=<pid> <unix time>` at
the moments that matter for the time to the first committed part (inputs checked, Prefect API
up, Ray up, replicas loaded, a shard worker ready, a part committed). The pid lets the chaos
suite kill exactly the process that reached a stage.

Sample trace (`GENRUN_SAMPLE_TRACE=<file>`): one line per finished trajectory, flushed at once;
it shows what a killed run had finished but not yet committed.

Failpoints (`GENRUN_FAILPOINTS`): named places where the chaos suite makes a run fail on
purpose. A timer cannot hit every window that matters (a part written, its checkpoint not yet),
so the suite arms named points:

    GENRUN_FAILPOINTS="after_part_write@2:kill,before_part_write@5:enospc"
    GENRUN_FAILPOINT_DIR=/some/dir

The 2nd time a process passes `failpoint("after_part_write")` it kills itself with SIGKILL, a
real crash at that exact point; `kill_run` kills the run's main process (the CLI) and then
itself, `enospc` raises the error a full disk raises, `hold` waits there (an hour), holding
the run in that stage for a test's signal. Each armed point fires once per run,
across processes and retries: firing creates `<name>.fired` in GENRUN_FAILPOINT_DIR
exclusively, so a retried shard does not crash again. Unset, `failpoint` costs one dict lookup.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from typing import TextIO

logger = logging.getLogger(__name__)

TIMELINE_ENV = "GENRUN_TIMELINE"
SAMPLE_TRACE_ENV = "GENRUN_SAMPLE_TRACE"


def mark(event: str) -> None:
    path = os.environ.get(TIMELINE_ENV)
    if path:
        with open(path, "a") as handle:
            handle.write(f"{event} pid={os.getpid()} {time.time():.3f}\n")


def read_timeline(timeline: str | os.PathLike) -> dict[str, list[float]]:
    """event -> unix times, in the order written (one per process that marked it)."""
    events: dict[str, list[float]] = {}
    with open(timeline) as handle:
        for line in handle.read().splitlines():
            events.setdefault(line.split()[0], []).append(float(line.split()[-1]))
    return events


def generation_phase(events: dict[str, list[float]]) -> tuple[float, float]:
    """(start, end) unix times of a run's generation phase, as the benchmarks define it: from the
    first shard worker ready with an engine up (engine_ready; engines that boot nothing, such as
    remote, mark none) to the last shard done."""
    started = min(events["shard_worker_ready"])
    if "engine_ready" in events:
        started = max(events["engine_ready"][0], started)
    return started, max(events["shard_done"])


class SampleTrace:
    """The sample trace of one stream (a no-op when GENRUN_SAMPLE_TRACE is unset)."""

    def __init__(self) -> None:
        path = os.environ.get(SAMPLE_TRACE_ENV)
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None

    def finished(self, index: int, rollout_n: int) -> None:
        if self._file is not None:
            self._file.write(f"{time.time():.3f} finished {index}:{rollout_n}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


FAILPOINTS_ENV = "GENRUN_FAILPOINTS"
FAILPOINT_DIR_ENV = "GENRUN_FAILPOINT_DIR"
ACTIONS = ("kill", "kill_run", "enospc", "hold")
# How long `hold` holds: far longer than any test waits for its signal.
HOLD_SECONDS = 3600.0
# The process that armed the failpoints (the CLI): Ray workers run in process groups of their
# own, so `kill_run` names the run's main process through the environment they inherit.
RUN_PID_ENV = "GENRUN_FAILPOINT_RUN_PID"


def _armed() -> dict[str, tuple[int, str]]:
    armed = {}
    for item in filter(None, (part.strip() for part in os.environ.get(FAILPOINTS_ENV, "").split(","))):
        name, _, rest = item.partition("@")
        hit, _, action = rest.partition(":")
        if not hit.isdigit() or action not in ACTIONS:
            raise ValueError(f"{FAILPOINTS_ENV}: cannot read {item!r}; write name@N:action with action in {ACTIONS}")
        armed[name] = (int(hit), action)
    return armed


_ARMED = _armed()
if _ARMED:
    os.environ.setdefault(RUN_PID_ENV, str(os.getpid()))
_passes: dict[str, int] = {}


def failpoint(name: str) -> None:
    if name not in _ARMED:
        return
    hit, action = _ARMED[name]
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] != hit or not _claim(name):
        return
    logger.warning("failpoint %s fired (%s)", name, action)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "kill_run":
        # The run's main process, then this one: a kill -9 of `genrun` landing exactly here.
        os.kill(int(os.environ.get(RUN_PID_ENV, os.getpid())), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hold":
        time.sleep(HOLD_SECONDS)
        return
    raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")


def _claim(name: str) -> bool:
    """True for the one process that fires `name` in this run."""
    directory = os.environ.get(FAILPOINT_DIR_ENV)
    if not directory:
        return True
    try:
        os.close(os.open(os.path.join(directory, f"{name}.fired"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
