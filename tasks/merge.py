"""Prefect task: merge the committed parts into trajectories.pkl and write manifest.json."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from generation_core.run import RunPlan, finish_run


@task(name="merge", cache_policy=NO_CACHE)
def merge(plan: RunPlan, manifests: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    return finish_run(plan, manifests, elapsed)
