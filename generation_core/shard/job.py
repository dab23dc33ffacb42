"""The shard job: decide whether a shard needs work, and do it. Every dispatcher submits this.

`run_shard_job(plan, shard, ...)` runs in any process of the run's Ray job (a Prefect task on a
Ray worker, or the in-process dispatcher). It receives its `ShardSpec` and never plans. In order:

1. folds the shard's commit log once (`ShardCheckpoint.load`): the view every later step uses;
2. repairs: every committed part is read and checked against its record, and a damaged one is
   dropped with a `repair` record, logged, its samples pending again (store/part_repair.py);
3. decides from the run folder alone whether the shard has anything left to do
   (shard/finished.py `is_finished`: a success marker that names the shard's last commit
   record, its `done` record; no recorded failures; its rows unchanged). The flow asks the same
   question for every shard as a run starts (`finished_shards`) and hands the answer on to
   Prefect's cache policy;
4. otherwise takes its prompts and a worker from its `WorkerFactory` (shard/protocols.py; the
   run's own is `PoolWorkers`: the shard's rows and the booted replica pool), runs one attempt
   (shard/attempt.py) and finishes the shard last (`write_marker`: the done record, created
   exclusively under the lease, then the marker).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import ray

from generation_core.inputs.agent_loops import check_agent_loops
from generation_core.inputs.shard_rows import DatasetPrompts
from generation_core.inputs.tokenizer import run_tokenizer
from generation_core.instrumentation import mark
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.serving.pool import attach_client
from generation_core.shard.attempt import generate_shard
from generation_core.shard.finished import check_rows_unchanged, is_finished, rows_digest_reader
from generation_core.shard.progress import ShardReporter, ShardStopped
from generation_core.shard.protocols import ShardPrompts, WorkerFactory
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from generation_core.store.commit_log import ShardCheckpoint, read_marker, write_marker
from generation_core.store.lease import LeaseFence
from generation_core.store.part_repair import repair_damaged_parts
from generation_core.store.run_folder import SuccessMarker

logger = logging.getLogger(__name__)

# How long a shard job waits for the driver to boot the replicas (SGLang on a large model takes
# minutes); the driver cancels its shard jobs at once when the boot fails.
POOL_BOOT_WAIT_SECONDS = 1800.0


def run_shard_job(
    plan: RunPlan,
    shard: ShardSpec,
    *,
    registry_name: str | None = None,
    lease_generation: int | None = None,
    progress_board: str | None = None,
    rows_checked: bool = False,
    worker_factory: WorkerFactory | None = None,
) -> SuccessMarker:
    """Run one shard if it needs work (the module docstring says how). `registry_name`: the
    replica pool's registry, for the run's own workers (`PoolWorkers`). `lease_generation`: the
    run's lease on the folder (commits stop if a later run takes it). `progress_board`: the run's
    ProgressBoard actor, which gets this job's counters and may ask it to stop (ShardStopped,
    after committing what finished). `rows_checked`: the flow found this shard finished as the
    run started and checked its rows then (`finished_shards`); a job run because Prefect had no
    cached result does not read them again. `worker_factory`: where the prompts and the worker
    come from (a library caller's or a test's own; None: `PoolWorkers(registry_name)`)."""
    folder = plan.folder
    fence = LeaseFence(lease_generation) if lease_generation is not None else None
    # The shard's commit log, folded once: the repair, the decision, the attempt record, every
    # part and the done record go through this one view (on S3 a fold is a listing and a GET
    # per record).
    checkpoint = ShardCheckpoint.load(folder, shard.name, fence)
    repair_damaged_parts(folder, shard.name, checkpoint, fence)
    marker = read_marker(folder, shard.name, checkpoint)
    if is_finished(marker, checkpoint):
        check_rows_unchanged(
            folder, shard, checkpoint.rows_digest, None if rows_checked else rows_digest_reader(plan, shard)
        )
        return marker.as_skipped()
    reporter = ShardReporter.attach(progress_board, shard.shard_id)
    if reporter.stop_requested_now():
        raise ShardStopped(f"{shard.name}: the run is stopping; not started")
    if worker_factory is None:
        if registry_name is None:
            raise TypeError("run_shard_job needs the replica pool's registry_name, or a worker_factory of its own")
        worker_factory = PoolWorkers(registry_name)
    prompts = worker_factory.prompts(plan, shard)

    async def attempt() -> tuple[SuccessMarker, ShardCheckpoint]:
        async with worker_factory.worker(plan, shard) as worker:
            worker.provenance["model_digest"] = plan.model_digest
            return await generate_shard(plan, shard, folder, checkpoint, prompts, worker, fence, reporter)

    marker, attempted = asyncio.run(attempt())
    marker.last_attempt.worker = _where_this_runs()
    write_marker(folder, marker, fence, attempted)
    mark(f"shard_done {shard.shard_id}")
    return marker


class PoolWorkers:
    """The run's own `WorkerFactory`: the shard's rows from the dataset (`dataset_prompts`) and a
    streaming worker on the replica pool registered as `registry_name`, with the run's reward
    function."""

    def __init__(self, registry_name: str):
        self.registry_name = registry_name

    def prompts(self, plan: RunPlan, shard: ShardSpec) -> ShardPrompts:
        return dataset_prompts(plan, shard)

    @asynccontextmanager
    async def worker(self, plan: RunPlan, shard: ShardSpec) -> AsyncIterator[StreamingWorker]:
        cfg, settings = plan.cfg, plan.settings
        client = attach_client(cfg, self.registry_name, routing=settings.routing)
        scorer = RewardScorer.from_config(cfg, run_tokenizer(cfg.actor_rollout_ref.model), settings)
        worker = StreamingWorker(cfg, client, scorer, settings=settings)
        mark(f"shard_worker_ready {shard.shard_id}")
        try:
            # The driver may still be loading the model: shard jobs start beside it.
            await client.connect(wait_seconds=POOL_BOOT_WAIT_SECONDS)
            yield worker
        finally:
            await client.aclose()
            worker.shutdown()


def dataset_prompts(plan: RunPlan, shard: ShardSpec) -> DatasetPrompts:
    """The shard's prompts: only its rows, read and filtered here (never the whole dataset). The
    agent loops they name are checked again, as the preflight did: this process (a Ray worker)
    loads plugins and YAML itself."""
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, run_tokenizer(plan.cfg.actor_rollout_ref.model))
    check_agent_loops(plan.cfg, prompts.agent_names())
    return prompts


def _where_this_runs() -> dict:
    """The Ray node and the GPUs this shard job held (none: the replicas own the GPUs)."""
    if not ray.is_initialized():
        return {"node_id": None, "pid": os.getpid(), "gpu_ids": []}
    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
