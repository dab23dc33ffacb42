"""Prefect task: run one shard on a Ray worker (generation_core.shard.job.run_shard_job), and the
policy of when Prefect's cached result of a shard may stand in for running it (`shard_task`)."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

from prefect import Task, task
from prefect.client.schemas.objects import TaskRun
from prefect.states import Cancelled, Failed, State

from generation_core.errors import InputChanged
from generation_core.instrumentation import mark
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.shard.job import run_shard_job
from generation_core.shard.progress import ShardStopped
from generation_core.store.run_folder import SuccessMarker


@functools.lru_cache(maxsize=4)
def parsed_plan(plan: str) -> RunPlan:
    """The plan's JSON text (RunPlan.to_json) parsed once per process: every shard task of a run
    gets the same text, and both its cache key and its body read the plan."""
    return RunPlan.from_json(plan)


def run_identity(plan: RunPlan) -> str:
    """The run's part of every shard's cache key: its fingerprint and output folder."""
    folder = hashlib.sha256(plan.cfg.trainer.default_local_dir.encode()).hexdigest()[:16]
    return f"genrun-{plan.fingerprint[:24]}-{folder}"


def shard_cache_key(_context, parameters: dict[str, Any]) -> str:
    """Same run, same output folder, same shard: never the flow-run id, so a retried or
    re-deployed flow run finds the shards an earlier run finished."""
    return f"{run_identity(parsed_plan(parameters['plan']))}-shard-{parameters['shard']['shard_id']:05d}"


REFUSED = "Refused"
"""The name of a shard task's final state when its input changed under the run (InputChanged):
Failed, never retried; the flow stops the run with its message (flows/generate.py)."""


def retry_unless_refused(_task: Task, _task_run: TaskRun, state: State) -> bool:
    """Prefect's retry condition: a shard whose input changed reads the same input again."""
    return state.name != REFUSED


def shard_task(finished: SuccessMarker | None, *, retries: int, retry_delay_seconds: float) -> Task:
    """The run_shard task as the flow submits it for one shard, given what `finished_shard`
    decided for it as the run started. Prefect's cached result of an earlier flow run may stand
    in only for a finished shard (its job would find nothing to do); a shard with work left
    always runs its job (refresh_cache), which decides again, reading every part."""
    return run_shard.with_options(
        retries=retries,
        retry_delay_seconds=retry_delay_seconds,
        refresh_cache=finished is None,
        retry_condition_fn=retry_unless_refused,
    )


@task(
    name="run_shard",
    task_run_name="shard-{shard[shard_id]:05d}",
    persist_result=True,
    cache_key_fn=shard_cache_key,
    result_serializer="json",
)
def run_shard(
    plan: str,
    shard: dict[str, int],
    registry_name: str,
    lease_generation: int | None = None,
    progress_board: str | None = None,
    rows_checked: bool = False,
) -> dict[str, Any] | State:
    """`plan`: the run's plan as JSON text (RunPlan.to_json), as every task of the flow takes it.
    `rows_checked`: the flow checked this finished shard's rows as the run started. A shard
    stopped because the run is stopping ends Cancelled: not retried, not cached; one whose input
    changed ends Failed as REFUSED (not retried, not cached), its message the refusal."""
    mark(f"shard_task_start {shard['shard_id']}")
    try:
        marker = run_shard_job(
            parsed_plan(plan),
            ShardSpec.from_dict(shard),
            registry_name=registry_name,
            lease_generation=lease_generation,
            progress_board=progress_board,
            rows_checked=rows_checked,
        )
    except ShardStopped as stopped:
        return Cancelled(message=str(stopped))
    except InputChanged as changed:
        return Failed(name=REFUSED, message=str(changed))
    return marker.to_dict()
