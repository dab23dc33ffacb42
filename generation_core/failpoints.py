"""Failpoints: named places in the code where the chaos suite makes a run fail on purpose.

A timer cannot hit every window that matters (a part written, its checkpoint not yet), so the
suite arms named points through the environment, which every process of a run inherits (the
CLI, the flow, shard workers on Ray):

    GENRUN_FAILPOINTS="after_part_write@2:kill,before_part_write@5:enospc"
    GENRUN_FAILPOINT_DIR=/some/dir

The 2nd time a process passes `failpoint("after_part_write")` it kills itself with SIGKILL, a
real crash at that exact point; `kill_run` kills the run's main process (the CLI) and then
itself, `enospc` raises the error a full disk raises. Each armed point
fires once per run, across processes and retries: firing creates `<name>.fired` in
GENRUN_FAILPOINT_DIR exclusively, so a retried shard does not crash again. Unset (always,
outside tests), `failpoint` costs one dict lookup.
"""

from __future__ import annotations

import errno
import logging
import os
import signal

logger = logging.getLogger(__name__)

FAILPOINTS_ENV = "GENRUN_FAILPOINTS"
FAILPOINT_DIR_ENV = "GENRUN_FAILPOINT_DIR"
ACTIONS = ("kill", "kill_run", "enospc")
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
