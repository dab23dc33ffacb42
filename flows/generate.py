"""The generation flow: plan -> one run_shard task per shard on Ray -> merge -> publish.

Parameters are Hydra-style overrides (a list of strings), the same input the `genrun` CLI, a
deployment and the Prefect UI take; the CLI, which has run the preflight already, also hands
over its plan, so nothing is checked or planned twice. Replicas are booted once per flow run
and shared by every shard task; they are torn down when the flow ends, also when it fails.

While shards run, the flow shows the run's progress (RunWatch: the shard jobs' counters, in the
terminal and in the progress artifact) and watches for a Ctrl-C (interrupt.STOP): then no shard
starts, running shard jobs commit what has finished and stop, and the flow run ends Cancelled
(the lease released on the way out); the same command resumes.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from typing import Any, cast
from uuid import UUID

import httpx
import ray
from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture, PrefectWrappedFuture
from prefect.states import Cancelled, State
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from flows.task_run_states import record_crash, wait_until_recorded
from generation_core.console import prints_to_debug_log
from generation_core.dispatch import boot_pool
from generation_core.engines.layout import SHARD_TASK_RESOURCES
from generation_core.instrumentation import mark
from generation_core.interrupt import STOP, Stopped
from generation_core.job import finished_shards
from generation_core.lease import LeaseFence, RunLease
from generation_core.plan import RunPlan, ShardSpec
from generation_core.pool import new_balancer_name
from generation_core.preflight import preflight
from generation_core.progress import ProgressTotals, committed_counts
from generation_core.ray_setup import RAY_WORKER_ENV, ray_init_kwargs
from generation_core.run_folder import ShardManifest
from generation_core.run_watch import RunWatch
from tasks.merge import merge
from tasks.publish import publish
from tasks.run_shard import shard_task

logger = logging.getLogger(__name__)


# How often the flow looks at the progress board and the Ctrl-C flag while shards run.
TICK_SECONDS = 0.5
# After a Ctrl-C, how long running shard jobs get to commit what has finished and stop.
STOP_GRACE_SECONDS = 15.0
# Before Ray stops, how long the shard task runs' final states get to reach the Prefect API.
RECORD_STATES_SECONDS = 10.0


class ShardsFailed(RuntimeError):
    """Raised after every shard has finished, when some shard exhausted its retries."""


@flow(name="generate")
def generate(overrides: list[str] | None = None, plan: dict[str, Any] | None = None) -> dict[str, Any] | State:
    started = time.perf_counter()
    run_plan = RunPlan.from_dict(plan) if plan is not None else preflight(list(overrides or []))
    try:
        # One run per output folder: a second run on it is refused here, before any model loads.
        with RunLease.acquire(run_plan.folder, run_plan.cfg.generation.lease_seconds) as lease:
            run_plan.claim_folder()
            return _generate_holding(run_plan, lease.fence(), started)
    except Stopped:
        # A Ctrl-C while waiting for the lease, booting replicas, merging or publishing
        # (STOP.interruptible): that stage ended at once, the lease is released on the way out.
        return _stopped(run_plan)


def _generate_holding(plan: RunPlan, fence: LeaseFence, started: float) -> dict[str, Any] | State:
    artifact_key = plan.cfg.trainer.experiment_name.lower().replace("_", "-")
    progress = cast(UUID, create_progress_artifact(progress=0.0, key=f"{artifact_key}-progress", description="Trajectories committed (%)"))  # sync caller: the id
    # One JSON text, not a dict: Prefect walks every dict and list parameter looking for upstream
    # futures, at each submission and again in each task (about 0.1 s per shard for a resolved
    # config); a string it does not walk.
    job_plan = json.dumps(plan.to_dict(with_shards=False))
    gen = plan.cfg.generation
    manifests, failures, stopping = [], [], False
    # A Ray the caller started already (the CLI starts it beside the Prefect server) is used as is.
    with RayTaskRunner(init_kwargs=ray_init_kwargs(plan.cfg, plan.fingerprint, RAY_WORKER_ENV)) as runner, RunWatch(
        plan, on_update=lambda totals: _update_artifact(progress, totals)
    ) as watch:
        mark("ray_ready")
        # Shard tasks first: their workers start (imports, tokenizer, prompts) while the
        # replicas load, and each waits for the pool by name.
        balancer_name = new_balancer_name()
        cached: set[int] = set()
        # future -> (its shard, retries left). Prefect retries a shard whose job raised inside
        # its task run; a shard whose worker died (Crashed: the task engine died with it) is
        # submitted again here, each crash taking one of the same generation.retries.
        pending: dict[PrefectFuture, tuple[ShardSpec, int]] = {}
        finished: queue.Queue[PrefectFuture] = queue.Queue()
        # Task runs whose workers reported their own final state (see task_run_states).
        reported: list[UUID] = []

        def submit(shard: ShardSpec, retries: int, marker: ShardManifest | None = None) -> None:
            # `marker`: the finished shard's manifest as `finished_shards` found it when the run
            # started, None for work left (a crashed worker's shard is submitted again as such).
            task = shard_task(marker, retries=retries, retry_delay_seconds=gen.retry_delay_seconds)
            parameters = {
                "plan": job_plan, "shard": shard.to_dict(), "balancer_name": balancer_name,
                "lease_generation": fence.generation, "progress_board": watch.board_name, "rows_checked": marker is not None,
            }
            # Shard tasks hold a CPU and never a GPU: the replicas own the GPUs. max_retries=0:
            # Ray never re-runs a dead shard worker behind Prefect's back (see below).
            with remote_options(**SHARD_TASK_RESOURCES, max_retries=0):
                future = runner.submit(task, parameters)
            pending[future] = (shard, retries)
            future.add_done_callback(finished.put)

        # The one decision, for every shard before any is submitted: Prefect's cache policy
        # (shard_task) needs it, and the rows of a finished shard are checked here because a
        # cached result never reaches the job.
        markers = finished_shards(plan, plan.shards, verify="size", fence=fence)
        for shard in plan.shards:
            marker = markers[shard.shard_id]
            if marker is not None:
                cached.add(shard.shard_id)
                watch.shard_finished(marker)
            submit(shard, gen.retries, marker)
        try:
            # Minutes for SGLang: a Ctrl-C ends the boot at once (Ray's shutdown stops the replicas).
            with prints_to_debug_log("verl"), STOP.interruptible():
                pool = boot_pool(plan, balancer_name)
        except BaseException:
            _cancel(pending)
            raise
        mark("engine_ready")
        try:
            stop_deadline = float("inf")
            while pending and time.monotonic() < stop_deadline:
                watch.tick()
                if STOP.requested() and not stopping:
                    # A first Ctrl-C: no new shard starts; running shard jobs commit what has
                    # finished and stop (ShardStopped: their task runs end Cancelled).
                    stopping, stop_deadline = True, time.monotonic() + STOP_GRACE_SECONDS
                    started_shards = watch.stop()
                    _cancel({f: s for f, s in pending.items() if s[0].shard_id not in started_shards})
                try:
                    future = finished.get(timeout=TICK_SECONDS)
                except queue.Empty:
                    continue
                shard, retries_left = pending.pop(future)
                future.wait()
                state = future.state
                if not state.is_crashed():
                    reported.append(future.task_run_id)
                elif not stopping:  # (after a Ctrl-C, a cancelled task that never started reads Crashed too)
                    record_crash(future.task_run_id, state)
                if state.is_crashed() and retries_left > 0 and not stopping:
                    logger.warning("%s: its worker died (%s); running it again (%d retries left)", shard.name, state.message, retries_left - 1)
                    time.sleep(gen.retry_delay_seconds)
                    submit(shard, retries_left - 1)
                elif state.is_completed():
                    manifest = ShardManifest.from_dict(future.result())
                    watch.shard_finished(manifest)
                    # A finished shard's result comes from Prefect's cache: it did no work now.
                    manifests.append(manifest.as_skipped() if manifest.shard_id in cached else manifest)
                elif not stopping:
                    failures.append(f"{shard.name} {state.name}: {state.message}")
            if pending:
                logger.warning("%d shard job(s) did not stop within %.0f s; Ray's shutdown stops them", len(pending), STOP_GRACE_SECONDS)
        finally:
            pool.shutdown()
        # After a Ctrl-C the exit must stay quick: the states get a moment, not the whole wait.
        wait_until_recorded(reported, 2.0 if stopping else RECORD_STATES_SECONDS)
    if stopping or STOP.requested():
        return _stopped(plan)
    if failures:
        raise ShardsFailed(
            f"{len(failures)} of {len(plan.shards)} shards failed (generation.retries={gen.retries}): {'; '.join(failures)}; "
            "committed trajectories are kept, run the same command again to resume"
        )
    manifests.sort(key=lambda m: m.shard_id)
    # Every shard is committed: a Ctrl-C ends the merge or the publish at once, and the same
    # command does them again (the merged files are written whole or not at all).
    with STOP.interruptible():
        summary = merge(plan, manifests, time.perf_counter() - started, fence)
        mark("merged")
        return publish(plan, summary, manifests, artifact_key, fence)


def _cancel(futures: dict[PrefectFuture, Any]) -> None:
    """Cancel shard tasks Ray has not started (or that have not reached their stream yet)."""
    for future in futures:
        try:
            ray.cancel(cast(PrefectWrappedFuture, future).wrapped_future)  # RayTaskRunner's futures wrap Ray's
        except Exception as exc:  # noqa: BLE001 - Ray's shutdown stops what is left
            logger.debug("could not cancel %s: %s", future.task_run_id, exc)


def _update_artifact(artifact_id: UUID, totals: ProgressTotals) -> None:
    try:
        update_progress_artifact(artifact_id, progress=round(totals.percent, 2), description=totals.line())
    except httpx.TransportError as exc:
        # The progress bar is cosmetic: a Prefect API that stays away past its client's retries
        # (a server restart that takes long) must not fail a run whose shards finished; what
        # does need the API fails with a clear message.
        logger.warning("could not update the progress artifact (Prefect API unreachable: %s)", exc)


def _stopped(plan: RunPlan) -> State:
    """The flow run's end after a Ctrl-C: Cancelled, saying what is kept."""
    counts = committed_counts(plan.folder, [s.shard_id for s in plan.shards])
    message = f"stopped on request: {sum(counts.values()):,} trajectories committed in {plan.folder.display()}; run the same command again to resume"
    logger.debug("%s", message)
    return Cancelled(message=message)
