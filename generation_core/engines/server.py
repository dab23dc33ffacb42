"""The Ray actor that serves one engine: `EngineServer`, and what it does in its own process.

replicas.py (the driver's side: verl's RolloutReplica for our engines) starts one EngineServer
per replica and hands it a builder, a picklable callable that makes the engine in the actor's
process. This module, and what a builder names, import no verl: unpickling the actor's class
and its builder imports their modules in the replica process, and verl's import (tensordict,
torch._dynamo) is ~6 CPU-seconds of the machine the replicas and shard workers share. The
instant engine's replica imports neither torch nor transformers; the transformers engine's
imports them and nothing else heavy.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from generation_core.engines.base import Engine
from generation_core.engines.request_batching import serve_batch
from generation_core.instrumentation import mark

logger = logging.getLogger(__name__)


class EngineServer:
    """Ray actor body: one engine, many concurrent `generate` calls (an async actor)."""

    def __init__(self, build_engine: Callable[[], Engine]):
        # Runs again when Ray restarts a crashed engine actor.
        _run_at_normal_priority()
        self.engine = build_engine()
        self.outstanding = 0
        """Requests this replica holds now, from every shard worker's batched calls: its load,
        which the routing clients share (it comes back with every group of answers, and from
        `load`)."""
        mark("replica_ready")

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return await self.engine.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)

    async def serve_batch(self, requests: list[dict]):
        """Many `generate` calls in one Ray call, answered as they finish (request_batching.py),
        each group with this replica's load after it."""
        async for answers in serve_batch(self._generate_counted, requests):
            yield answers, self.outstanding

    async def _generate_counted(self, **request):
        self.outstanding += 1
        try:
            return await self.generate(**request)
        finally:
            self.outstanding -= 1

    def load(self) -> int:
        """Requests outstanding here (a routing client asks when no answer told it lately)."""
        return self.outstanding

    def health(self) -> dict:
        # torch's threads where the engine runs on torch; an engine without it never imports it.
        torch = sys.modules.get("torch")
        return dict(
            self.engine.stats,
            pid=os.getpid(),
            nice=os.getpriority(os.PRIO_PROCESS, 0),
            torch_threads=torch.get_num_threads() if torch else None,
        )

    # verl's replica API: weights never change during generation, so these are no-ops.
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()


def _run_at_normal_priority() -> None:
    """Ray starts its worker processes at nice 15, the engine's actor included: on a busy machine
    the engine, whose batch steps are the run's throughput, would lose the CPU to the shard
    workers, Prefect and Ray's daemons. Back to nice 0 where the process may (root, or
    CAP_SYS_NICE); otherwise it stays where Ray put it, level with the shard workers."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except (PermissionError, AttributeError):  # AttributeError: no setpriority on this platform
        logger.info(
            "the engine process keeps nice %d (raising its priority needs CAP_SYS_NICE)",
            os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0,
        )


def cpu_threads_per_replica(replicas_on_node: int) -> int:
    """Torch threads of one CPU engine replica: the CPUs this process may use (its affinity
    mask, which containers and taskset narrow) shared by the replicas of its node; more threads
    than cores only make the replicas preempt each other mid-matmul."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, usable // max(1, replicas_on_node))
