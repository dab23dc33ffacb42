"""Prefect task: run one shard on a Ray worker (generation_core.job.run_shard_job)."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from prefect import task
from prefect.states import Cancelled, State

from generation_core.instrumentation import mark
from generation_core.job import run_shard_job
from generation_core.plan import RunPlan, ShardSpec
from generation_core.progress import ShardStopped


@functools.lru_cache(maxsize=4)
def run_identity(plan: str) -> str:
    """The run's part of every shard's cache key, from the plan's JSON text: parsed once per
    flow run (every shard task of a run gets the same text), not once per shard."""
    parsed = json.loads(plan)
    folder = hashlib.sha256(parsed["config"]["trainer"]["default_local_dir"].encode()).hexdigest()[:16]
    return f"genrun-{parsed['fingerprint'][:24]}-{folder}"


def shard_cache_key(_context, parameters: dict[str, Any]) -> str:
    """Same run, same output folder, same shard: never the flow-run id, so a retried or
    re-deployed flow run finds the shards an earlier run finished."""
    return f"{run_identity(parameters['plan'])}-shard-{parameters['shard']['shard_id']:05d}"


@task(name="run_shard", task_run_name="shard-{shard[shard_id]:05d}", persist_result=True, cache_key_fn=shard_cache_key, result_serializer="json")
def run_shard(plan: str, shard: dict[str, int], balancer_name: str, lease_generation: int | None = None, progress_board: str | None = None) -> dict[str, Any] | State:
    """`plan`: RunPlan.to_dict() as JSON text (flows/generate.py says why not a dict). A shard
    stopped because the run is stopping ends Cancelled: not retried, not cached."""
    mark(f"shard_task_start {shard['shard_id']}")
    try:
        manifest = run_shard_job(
            RunPlan.from_dict(json.loads(plan)), ShardSpec.from_dict(shard),
            balancer_name=balancer_name, lease_generation=lease_generation, progress_board=progress_board,
        )
    except ShardStopped as stopped:
        return Cancelled(message=str(stopped))
    return manifest.to_dict()
