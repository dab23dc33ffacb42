"""The generation flow: plan -> one run_shard task per shard on Ray -> merge -> publish.

Parameters are Hydra-style overrides (a list of strings), the same input the `genrun` CLI, a
deployment and the Prefect UI take; the CLI, which has run the preflight already, also hands
over its plan, so nothing is checked or planned twice. Replicas are booted once per flow run
and shared by every shard task; they are torn down when the flow ends, also when it fails.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture, as_completed
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from generation_core.data import ShardSpec
from generation_core.dispatch import boot_pool
from generation_core.engines.layout import SHARD_TASK_RESOURCES
from generation_core.instrumentation import mark
from generation_core.job import finished_shard
from generation_core.lease import LeaseFence, RunLease
from generation_core.pool import new_balancer_name
from generation_core.preflight import RunPlan, preflight
from generation_core.ray_setup import RAY_WORKER_ENV, ray_init_kwargs
from generation_core.run_folder import ShardManifest
from tasks.merge import merge
from tasks.publish import publish
from tasks.run_shard import run_shard

logger = logging.getLogger(__name__)


class ShardsFailed(RuntimeError):
    """Raised after every shard has finished, when some shard exhausted its retries."""


@flow(name="generate")
def generate(overrides: list[str] | None = None, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    run_plan = RunPlan.from_dict(plan) if plan is not None else preflight(list(overrides or []))
    # One run per output folder: a second run on it is refused here, before any model loads.
    with RunLease.acquire(run_plan.folder, run_plan.cfg.generation.lease_seconds) as lease:
        run_plan.claim_folder()
        return _generate_holding(run_plan, lease.fence(), started)


def _generate_holding(plan: RunPlan, fence: LeaseFence, started: float) -> dict[str, Any]:
    artifact_key = plan.cfg.trainer.experiment_name.lower().replace("_", "-")
    progress = create_progress_artifact(progress=0.0, key=f"{artifact_key}-progress", description="Shards finished (%)")
    # One JSON text, not a dict: Prefect walks every dict and list parameter looking for upstream
    # futures, at each submission and again in each task (about 0.1 s per shard for a resolved
    # config); a string it does not walk.
    job_plan = json.dumps(plan.to_dict(with_shards=False))
    # A Ray the caller started already (the CLI starts it beside the Prefect server) is used as is.
    with RayTaskRunner(init_kwargs=ray_init_kwargs(plan.cfg, plan.fingerprint, RAY_WORKER_ENV)) as runner:
        mark("ray_ready")
        # Shard tasks first: their workers start (imports, tokenizer, prompts) while the
        # replicas load, and each waits for the pool by name.
        balancer_name = new_balancer_name()
        gen = plan.cfg.generation
        cached: set[int] = set()

        def submit(shard: ShardSpec, retries: int, needs_work: bool = True) -> PrefectFuture:
            task = run_shard.with_options(retries=retries, retry_delay_seconds=gen.retry_delay_seconds, refresh_cache=needs_work)
            parameters = {"plan": job_plan, "shard": shard.to_dict(), "balancer_name": balancer_name, "lease_generation": fence.generation}
            # Shard tasks hold a CPU and never a GPU: the replicas own the GPUs. max_retries=0:
            # Ray never re-runs a dead shard worker behind Prefect's back (see below).
            with remote_options(**SHARD_TASK_RESOURCES, max_retries=0):
                return runner.submit(task, parameters)

        # future -> (its shard, retries left). Prefect retries a shard whose job raised inside
        # its task run; a shard whose worker died (Crashed: the task engine died with it) is
        # submitted again here, each crash taking one of the same generation.retries.
        pending: dict[PrefectFuture, tuple[ShardSpec, int]] = {}
        for shard in plan.shards:
            # Prefect's cached result may stand in for a shard only when the shard job would
            # find nothing to do (the job decides again, reading every part, when it runs).
            needs_work = finished_shard(plan.folder, shard, verify="size", fence=fence) is None
            if not needs_work:
                cached.add(shard.shard_id)
            pending[submit(shard, gen.retries, needs_work)] = (shard, gen.retries)
        try:
            pool = boot_pool(plan, balancer_name)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        mark("engine_ready")
        try:
            manifests, failures, finished = [], [], 0
            while pending:
                resubmitted: dict[PrefectFuture, tuple[ShardSpec, int]] = {}
                for future in as_completed(list(pending)):
                    future.wait()
                    shard, retries_left = pending[future]
                    state = future.state
                    if state.is_crashed() and retries_left > 0:
                        logger.warning("%s: its worker died (%s); running it again (%d retries left)", shard.name, state.message, retries_left - 1)
                        time.sleep(gen.retry_delay_seconds)
                        resubmitted[submit(shard, retries_left - 1)] = (shard, retries_left - 1)
                        continue
                    finished += 1
                    if state.is_completed():
                        manifest = ShardManifest.from_dict(future.result())
                        # A finished shard's result comes from Prefect's cache: it did no work now.
                        manifests.append(manifest.as_skipped() if manifest.shard_id in cached else manifest)
                    else:
                        failures.append(f"{shard.name} {state.name}: {state.message}")
                    try:
                        update_progress_artifact(progress, progress=100.0 * finished / len(plan.shards))
                    except httpx.TransportError as exc:
                        # The progress bar is cosmetic: a Prefect API that stays away past its
                        # client's retries (a server restart that takes long) must not fail a run
                        # whose shards finished; what does need the API fails with a clear message.
                        logger.warning("could not update the progress artifact (Prefect API unreachable: %s)", exc)
                pending = resubmitted
        finally:
            pool.shutdown()
    if failures:
        raise ShardsFailed(
            f"{len(failures)} of {len(plan.shards)} shards failed (generation.retries={gen.retries}): {'; '.join(failures)}; "
            "committed trajectories are kept, run the same command again to resume"
        )
    manifests.sort(key=lambda m: m.shard_id)
    summary = merge(plan, manifests, time.perf_counter() - started, fence)
    mark("merged")
    return publish(plan, summary, manifests, artifact_key)
