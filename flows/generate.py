"""The generation flow: plan -> one run_shard task per shard on Ray -> merge -> publish.

Parameters are Hydra-style overrides (a list of strings), the same input the `genrun` CLI, a
deployment and the Prefect UI take; the CLI, which has run the preflight already, also hands
over its plan (RunPlan.to_json's text), so nothing is checked or planned twice. That text is the
one shape of the plan every task here takes (run_shard, merge, publish): the flow passes it on as
it came, and each task parses it once.

The run's sequence (lease, replicas booted once and shared by every shard task, progress, Ctrl-C,
merge, publish) is generation_core.driver.run_driver's, the same as the in-process dispatcher's; what is
the flow's own is how a shard job reaches a worker (`ShardTasksOnRay`: a run_shard task on Ray,
resubmitted when its worker dies), the merge and publish as Prefect tasks with the UI's
artifacts, and the end after a Ctrl-C: the flow run ends Cancelled (the lease released on the
way out); the same command resumes.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, cast
from uuid import UUID

import httpx
import ray
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture, PrefectWrappedFuture
from prefect.states import Cancelled, State
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from flows.task_run_states import record_crash, wait_until_recorded
from generation_core.config.layout import SHARD_TASK_RESOURCES
from generation_core.driver.run_driver import ShardEnded, ShardJobArgs, drive_run, stopped_message
from generation_core.driver.run_progress import ProgressTotals
from generation_core.driver.stall_alarm import Stall
from generation_core.errors import GenrunError
from generation_core.preflight.preflight import preflight
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.serving.ray_setup import RAY_WORKER_ENV, ray_init_kwargs
from generation_core.shard.finished import finished_shards
from generation_core.store.lease import LeaseFence
from generation_core.store.run_folder import SuccessMarker
from tasks.merge import merge
from tasks.publish import publish
from tasks.run_shard import REFUSED, shard_task

logger = logging.getLogger(__name__)


# Before Ray stops, how long the shard task runs' final states get to reach the Prefect API.
RECORD_STATES_SECONDS = 10.0


@flow(name="generate")
def generate(overrides: list[str] | None = None, plan: str | None = None) -> dict[str, Any] | State:
    started = time.perf_counter()
    run_plan = RunPlan.from_json(plan) if plan is not None else preflight(list(overrides or []))
    plan_text = plan if plan is not None else run_plan.to_json()
    shard_tasks = ShardTasksOnRay(run_plan, plan_text)
    result = drive_run(
        run_plan,
        shard_tasks,
        started=started,
        # The tasks take the plan's text, not the driver's RunPlan (the first argument).
        finish=lambda _run, markers, elapsed, fence: merge(plan_text, markers, elapsed, fence),
        publish=lambda _run, summary, markers, fence: publish(
            plan_text, summary, markers, shard_tasks.artifact_key, fence
        ),
        on_progress=shard_tasks.update_progress_artifact,
        on_stall=shard_tasks.stall_alarm,
    )
    return result if result is not None else _stopped(run_plan)


class ShardTasksOnRay:
    """The flow's shard submitter (generation_core.driver.run_driver.ShardSubmitter): one run_shard task
    per shard, submitted to Ray through Prefect's RayTaskRunner; and the flow run's progress
    artifact, created once the run holds its folder, which mirrors the terminal's line.

    Prefect retries a shard whose job raised inside its task run; a shard whose worker died
    (Crashed: the task engine died with it) is submitted again here, each crash taking one of the
    same generation.retries."""

    def __init__(self, plan: RunPlan, plan_text: str):
        """`plan_text`: `plan` as the flow got it (RunPlan.to_json), handed on to every shard task."""
        self.plan = plan
        self.artifact_key = plan.cfg.trainer.experiment_name.lower().replace("_", "-")
        self.progress_artifact: UUID | None = None
        self.plan_text = plan_text
        # A Ray the caller started already (the CLI starts it beside the Prefect server) is used as is.
        self.runner = RayTaskRunner(init_kwargs=ray_init_kwargs(plan.cfg, plan.fingerprint, RAY_WORKER_ENV))
        self.job: ShardJobArgs | None = None
        # future -> (its shard, retries left).
        self.futures: dict[PrefectFuture, tuple[ShardSpec, int]] = {}
        # Crashed shards waiting out generation.retry_delay_seconds: (when, shard, retries left).
        # next_ended submits them when due, so the driver's loop never sleeps the delay.
        self.resubmit_at: list[tuple[float, ShardSpec, int]] = []
        self.finished: queue.Queue[PrefectFuture] = queue.Queue()
        # Shards whose result Prefect's cache stands in for: they did no work now.
        self.cached: set[int] = set()
        # Task runs whose workers reported their own final state (see task_run_states).
        self.reported: list[UUID] = []
        self.stopping = False

    def __enter__(self) -> ShardTasksOnRay:
        self.progress_artifact = cast(
            UUID,
            create_progress_artifact(
                progress=0.0, key=f"{self.artifact_key}-progress", description="Trajectories committed (%)"
            ),
        )  # sync caller: the id
        self.runner.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if exc_info[0] is None:
                # Before Ray stops. After a Ctrl-C the exit must stay quick: the states get a
                # moment, not the whole wait.
                wait_until_recorded(self.reported, 2.0 if self.stopping else RECORD_STATES_SECONDS)
        finally:
            self.runner.__exit__(*exc_info)

    def update_progress_artifact(self, totals: ProgressTotals) -> None:
        if self.progress_artifact is not None:
            _update_artifact(self.progress_artifact, totals)

    def stall_alarm(self, stall: Stall) -> None:
        """The stall alarm in the flow run: a warning in its log and a markdown artifact."""
        get_run_logger().warning("%s", stall.message())
        create_markdown_artifact(
            key=f"{self.artifact_key}-stall",
            description="The run stalled",
            markdown=f"**Stalled**: {stall.message()}\n\n`genrun status {self.plan.folder.display()}` shows each shard.",
        )

    def submit(self, job: ShardJobArgs) -> list[SuccessMarker]:
        self.job = job
        fence = LeaseFence(job.lease_generation)
        plan = self.plan
        # The one decision, for every shard before any is submitted: Prefect's cache policy
        # (shard_task) needs it, and the rows of a finished shard are checked here because a
        # cached result never reaches the job.
        markers = finished_shards(plan, plan.shards, fence=fence)
        known: list[SuccessMarker] = []
        for shard in plan.shards:
            marker = markers[shard.shard_id]
            if marker is not None:
                self.cached.add(shard.shard_id)
                known.append(marker)
            self._submit(shard, plan.settings.retries, marker)
        return known

    def _submit(self, shard: ShardSpec, retries: int, marker: SuccessMarker | None = None) -> None:
        """`marker`: the finished shard's marker as `finished_shards` found it when the run
        started; None for work left (a crashed worker's shard is submitted again as such)."""
        assert self.job is not None, "submit() first"
        task = shard_task(marker, retries=retries, retry_delay_seconds=self.plan.settings.retry_delay_seconds)
        parameters = {
            "plan": self.plan_text,
            "shard": shard.to_dict(),
            "registry_name": self.job.registry_name,
            "lease_generation": self.job.lease_generation,
            "progress_board": self.job.progress_board,
            "rows_checked": marker is not None,
        }
        # Shard tasks hold a CPU and never a GPU: the replicas own the GPUs. max_retries=0:
        # Ray never re-runs a dead shard worker behind Prefect's back (see the class).
        with remote_options(**SHARD_TASK_RESOURCES, max_retries=0):
            future = self.runner.submit(task, parameters)
        self.futures[future] = (shard, retries)
        future.add_done_callback(self.finished.put)

    def pending(self) -> int:
        return len(self.futures) + len(self.resubmit_at)

    def stop(self, started: set[int]) -> None:
        self.stopping = True
        self.resubmit_at.clear()  # not started: nothing to cancel
        _cancel({f: s for f, s in self.futures.items() if s[0].shard_id not in started})

    def next_ended(self, timeout: float) -> ShardEnded | None:
        now = time.monotonic()
        for due in [entry for entry in self.resubmit_at if entry[0] <= now]:
            self.resubmit_at.remove(due)
            self._submit(due[1], due[2])
        if self.resubmit_at:
            timeout = max(0.0, min(timeout, min(when for when, _, _ in self.resubmit_at) - now))
        try:
            future = self.finished.get(timeout=timeout)
        except queue.Empty:
            return None
        shard, retries_left = self.futures.pop(future)
        future.wait()
        state = future.state
        if not state.is_crashed():
            self.reported.append(future.task_run_id)
        elif not self.stopping:  # (after a Ctrl-C, a cancelled task that never started reads Crashed too)
            record_crash(future.task_run_id, state)
        if state.is_crashed() and retries_left > 0 and not self.stopping:
            logger.warning(
                "%s: its worker died (%s); running it again (%d retries left)",
                shard.name,
                state.message,
                retries_left - 1,
            )
            self.resubmit_at.append(
                (time.monotonic() + self.plan.settings.retry_delay_seconds, shard, retries_left - 1)
            )
            return None
        if state.is_failed() and state.name == REFUSED:
            # The shard's input changed under the run (tasks/run_shard.py): every shard reads the
            # same input, so the run stops with the refusal, one line, as a changed finished shard
            # stops it before any starts.
            raise GenrunError(state.message)
        if state.is_completed():
            marker = SuccessMarker.from_dict(future.result())
            # A finished shard's result comes from Prefect's cache: it did no work now.
            return ShardEnded(shard, marker.as_skipped() if marker.shard_id in self.cached else marker)
        return ShardEnded(shard, None, f"{shard.name} {state.name}: {state.message}")


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
    message = stopped_message(plan)
    logger.debug("%s", message)
    return Cancelled(message=message)
