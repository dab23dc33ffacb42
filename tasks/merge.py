"""Prefect task: merge the committed parts and write manifest.json (generation_core.outputs.finish.finish_run)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from generation_core.outputs.finish import finish_run
from generation_core.run_plan import RunPlan
from generation_core.store.lease import LeaseFence
from generation_core.store.run_folder import SuccessMarker


@task(name="merge", cache_policy=NO_CACHE)
def merge(
    plan: str,
    markers: list[SuccessMarker],
    elapsed: float,
    fence: LeaseFence | None = None,
) -> dict[str, Any]:
    """`plan`: the run's plan as JSON text (RunPlan.to_json), as every task of the flow takes it."""
    return finish_run(RunPlan.from_json(plan), markers, elapsed, fence)
