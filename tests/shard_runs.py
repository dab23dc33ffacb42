"""A shard job in the test's process with the test's own prompts and worker: `run_shard_job`, the
one path every dispatcher takes, given a worker factory (shard/protocols.py) that hands them over."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from generation_core.run_plan import DatasetFiles, RunPlan, ShardSpec
from generation_core.shard.job import run_shard_job
from generation_core.shard.protocols import ShardPrompts, StreamWorker
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseFence
from generation_core.store.run_folder import SuccessMarker


class GivenWorker:
    """A WorkerFactory that hands the job the prompts and the worker a test built (the test shuts
    its worker down). `entered(worker)`: called in the attempt's event loop once it has the worker."""

    def __init__(self, prompts: ShardPrompts, worker: StreamWorker, entered: Callable[[Any], None] | None = None):
        self._prompts, self._worker, self._entered = prompts, worker, entered

    def prompts(self, plan: RunPlan, shard: ShardSpec) -> ShardPrompts:
        return self._prompts

    @asynccontextmanager
    async def worker(self, plan: RunPlan, shard: ShardSpec) -> AsyncIterator[StreamWorker]:
        if self._entered is not None:
            self._entered(self._worker)
        yield self._worker


def one_shard_plan(cfg, shard: ShardSpec, folder: StorageFolder, dataset: DatasetFiles | None = None) -> RunPlan:
    """A plan of one shard whose run folder is `folder` (any StorageFolder, also one a test wraps)."""
    plan = RunPlan(cfg, "test", [shard], 0, dataset if dataset is not None else DatasetFiles((), 0))
    plan.folder = folder
    return plan


def run_shard(
    cfg,
    shard: ShardSpec,
    folder: StorageFolder,
    prompts: ShardPrompts,
    worker: StreamWorker,
    fence: LeaseFence | None = None,
    *,
    dataset: DatasetFiles | None = None,
    entered: Callable[[Any], None] | None = None,
) -> SuccessMarker:
    """`run_shard_job` for `shard` of a run in `folder`, with `prompts` and `worker`; `fence`: the
    run's lease; `dataset`: the input files (a finished shard's rows are checked against them)."""
    return run_shard_job(
        one_shard_plan(cfg, shard, folder, dataset),
        shard,
        lease_generation=None if fence is None else fence.generation,
        worker_factory=GivenWorker(prompts, worker, entered),
    )
