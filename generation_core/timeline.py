"""Startup timeline for the benchmarks: where the time to the first committed part goes.

With `GENRUN_TIMELINE=<file>` set, each process of a run (the CLI, the flow, shard workers on
Ray) appends `<event> <unix time>` lines to that local file at the moments that matter: input
checks done, Prefect API up, Ray up, engine replicas loaded, a shard worker ready, the first
part committed. Each line carries the pid of the process that wrote it. Unset (the default), `mark` does nothing.
"""

from __future__ import annotations

import os
import time

TIMELINE_ENV = "GENRUN_TIMELINE"


def mark(event: str) -> None:
    path = os.environ.get(TIMELINE_ENV)
    if path:
        with open(path, "a") as handle:
            # The pid lets the chaos suite kill exactly the process that reached a stage.
            handle.write(f"{event} pid={os.getpid()} {time.time():.3f}\n")
