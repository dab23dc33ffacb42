"""Prefect task: run one shard on a Ray worker (generation_core.run.run_shard_job)."""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import task

from generation_core.run import run_shard_job


def shard_cache_key(_context, parameters: dict[str, Any]) -> str:
    """Same run, same output folder, same shard: never the flow-run id, so a retried or
    re-deployed flow run finds the shards an earlier run finished."""
    folder = hashlib.sha256(parameters["config"]["trainer"]["default_local_dir"].encode()).hexdigest()[:16]
    return f"genrun-{parameters['fingerprint'][:24]}-{folder}-shard-{parameters['shard_id']:05d}"


@task(name="run_shard", task_run_name="shard-{shard_id:05d}", persist_result=True, cache_key_fn=shard_cache_key, result_serializer="json")
def run_shard(config: dict[str, Any], fingerprint: str, shard_id: int, balancer_name: str, lease_generation: int | None = None) -> dict[str, Any]:
    return run_shard_job(config, shard_id, balancer_name, lease_generation)
