"""The in-process dispatcher: the whole run in this process, shard after shard (library use,
notebooks, tests). The Prefect flow (flows/generate.py) is the other dispatcher; both only
submit `run_shard_job`, which alone decides whether a shard needs work."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from generation_core.finish import finish_run
from generation_core.instrumentation import failpoint
from generation_core.job import run_shard_job
from generation_core.lease import RunLease
from generation_core.plan import RunPlan
from generation_core.pool import ReplicaPool, new_balancer_name
from generation_core.publish import publish_run
from generation_core.ray_setup import start_ray


def boot_pool(plan: RunPlan, balancer_name: str) -> ReplicaPool:
    """Boot the run's replicas (once per run); the caller tears them down."""
    failpoint("boot_pool")
    return asyncio.run(ReplicaPool.boot(plan.cfg, balancer_name))


def run_in_process(plan: RunPlan) -> dict[str, Any]:
    """Generate every missing trajectory, merge, publish; returns the run summary."""
    started = time.perf_counter()
    with RunLease.acquire(plan.folder, plan.cfg.generation.lease_seconds) as lease:
        plan.claim_folder()
        start_ray(plan.cfg, plan.fingerprint)
        balancer_name = new_balancer_name()
        pool = boot_pool(plan, balancer_name)
        try:
            manifests = [
                run_shard_job(plan, shard, balancer_name=balancer_name, lease_generation=lease.fence().generation)
                for shard in plan.shards
            ]
        finally:
            pool.shutdown()
        summary = finish_run(plan, manifests, time.perf_counter() - started, lease.fence())
        summary["published"] = publish_run(plan.cfg, plan.folder, summary, fence=lease.fence())
    return summary
