"""The generation flow: plan shards -> one run_shard task per shard on Ray -> merge -> publish.

Parameters are Hydra-style overrides (a list of strings), the same input the `genrun` CLI, a
deployment and the Prefect UI take. Replicas are booted once per flow run and shared by every
shard task; they are torn down when the flow ends, also when it fails.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import httpx
from omegaconf import OmegaConf
from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import as_completed
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from generation_core.data import ShardSpec
from generation_core.engines.layout import SHARD_TASK_RESOURCES
from generation_core.errors import GenrunError
from generation_core.lease import LeaseFence, RunLease
from generation_core.part_integrity import repair_shard
from generation_core.pool import new_balancer_name
from generation_core.run import RunPlan, boot_pool, prepare_run, ray_init_kwargs
from generation_core.shard import finished_marker, skipped_attempt
from generation_core.timeline import mark
from tasks.merge import merge
from tasks.publish import publish
from tasks.run_shard import run_shard

logger = logging.getLogger(__name__)

# What shard tasks on Ray workers need from the driver's environment.
RAY_WORKER_ENV = ("PREFECT_API_URL", "HF_DATASETS_CACHE", "PYTHONPATH")


class ShardsFailed(RuntimeError):
    """Raised after every shard has finished, when some shard exhausted its retries."""


@flow(name="generate")
def generate(overrides: list[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    plan = prepare_run(list(overrides or []))
    # One run per output folder: a second run on it is refused here, before any model loads.
    with RunLease.acquire(plan.folder, plan.cfg.generation.lease_seconds) as lease:
        return _generate_holding(plan, lease.fence(), started)


def _generate_holding(plan: RunPlan, fence: LeaseFence, started: float) -> dict[str, Any]:
    artifact_key = plan.cfg.trainer.experiment_name.lower().replace("_", "-")
    progress = create_progress_artifact(progress=0.0, key=f"{artifact_key}-progress", description="Shards finished (%)")
    # A Ray the caller started already (the CLI starts it beside the Prefect server) is used as is.
    with RayTaskRunner(init_kwargs=ray_init_kwargs(plan.cfg, plan.fingerprint, forward_env=RAY_WORKER_ENV)) as runner:
        mark("ray_ready")
        # Shard tasks first: their workers start (imports, tokenizer, prompts) while the
        # replicas load, and each waits for the pool by name.
        balancer_name = new_balancer_name()
        tasks = {shard.shard_id: _shard_task(plan, shard) for shard in plan.shards}
        # Shard tasks hold a CPU and never a GPU: the replicas own the GPUs.
        with remote_options(**SHARD_TASK_RESOURCES):
            futures = [runner.submit(tasks[shard.shard_id][0], _shard_parameters(plan, shard.shard_id, balancer_name, fence)) for shard in plan.shards]
        try:
            pool = boot_pool(plan.cfg, balancer_name)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        mark("engine_ready")
        try:
            manifests, failures = [], []
            for finished, future in enumerate(as_completed(futures), start=1):
                future.wait()
                state = future.state
                if state.is_completed():
                    manifest = future.result()
                    # A finished shard's result comes from Prefect's cache: it did no work now.
                    manifests.append(manifest if tasks[manifest["shard_id"]][1] else skipped_attempt(manifest))
                else:
                    failures.append(f"{state.name}: {state.message}")
                try:
                    update_progress_artifact(progress, progress=100.0 * finished / len(futures))
                except httpx.TransportError as exc:
                    # The progress bar is cosmetic: a Prefect API that stays away past its
                    # client's retries (a server restart that takes long) must not fail a run
                    # whose shards finished; what does need the API fails with a clear message.
                    logger.warning("could not update the progress artifact (Prefect API unreachable: %s)", exc)
        finally:
            pool.shutdown()
    if failures:
        raise ShardsFailed(f"{len(failures)} of {len(futures)} shards failed after their retries: {'; '.join(failures)}")
    manifests.sort(key=lambda m: m["shard_id"])
    summary = merge(plan, manifests, time.perf_counter() - started)
    mark("merged")
    return publish(plan, summary, manifests, artifact_key)


def _shard_task(plan: RunPlan, shard: ShardSpec):
    gen = plan.cfg.generation
    # Storage markers are the source of truth: a cached result for a shard whose marker is gone
    # (folder deleted, run started over) or records failed samples (a rerun retries them) must
    # not stand in for the data.
    # A finished shard whose parts went missing or were truncated (one listing, no reads) is
    # repaired here, so this run regenerates what was lost; its task verifies every sha256.
    finished = finished_marker(plan.folder, shard) is not None
    needs_work = not finished or repair_shard(plan.folder, shard.name, size_only=True) > 0
    return run_shard.with_options(retries=gen.retries, retry_delay_seconds=gen.retry_delay_seconds, refresh_cache=needs_work), needs_work


def _shard_parameters(plan: RunPlan, shard_id: int, balancer_name: str, fence: LeaseFence) -> dict[str, Any]:
    return {
        "config": OmegaConf.to_container(plan.cfg, resolve=True),
        "fingerprint": plan.fingerprint,
        "shard_id": shard_id,
        "balancer_name": balancer_name,
        "lease_generation": fence.generation,
    }


if __name__ == "__main__":
    import sys

    try:
        print(generate(sys.argv[1:]))
    except GenrunError as exc:
        print(f"genrun: error: {exc}", file=os.sys.stderr)
        raise SystemExit(2) from None
