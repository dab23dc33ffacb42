"""The run driver: a run's sequence, held once for every dispatcher.

    take the lease -> start the shard jobs -> boot the replicas -> watch them (progress, Ctrl-C)
    -> stop the replicas -> merge -> publish

A dispatcher brings a `ShardSubmitter`, the one thing that differs between them: how a shard job
reaches a worker. The Prefect flow (flows/generate.py) submits a run_shard task per shard to Ray;
the in-process dispatcher (driver/in_process.py) runs `run_shard_job` shard after shard in a thread. Either
way the driver shows the run's progress (RunWatch) and hears a Ctrl-C (interrupt.STOP) the same:
no shard starts after it, running shard jobs commit what has finished and stop, and the run ends
stopped (`drive_run` answers None) with its lease released; the same command resumes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from generation_core.config.layout import REMOTE_ENGINE, ReplicaLayout, resolve_layout
from generation_core.console import prints_to_debug_log
from generation_core.driver.publish import publish_run
from generation_core.driver.run_progress import ProgressTotals, committed_counts
from generation_core.driver.run_watch import RunWatch
from generation_core.driver.stall_alarm import Stall
from generation_core.instrumentation import failpoint, mark
from generation_core.interrupt import STOP, Stopped
from generation_core.outputs.finish import finish_run
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.serving.pool import ReplicaPool, new_registry_name
from generation_core.serving.ray_setup import check_replicas_fit
from generation_core.store.lease import LeaseFence, RunLease
from generation_core.store.run_folder import SuccessMarker

logger = logging.getLogger(__name__)

# How often the driver looks at the progress board and the Ctrl-C flag while shards run.
TICK_SECONDS = 0.5
# After a Ctrl-C, how long running shard jobs get to commit what has finished and stop.
STOP_GRACE_SECONDS = 15.0


class ShardsFailed(RuntimeError):
    """Raised after every shard has finished, when some shard exhausted its retries."""


@dataclass(frozen=True)
class ShardJobArgs:
    """What every shard job of a run is given besides its plan and shard (job.run_shard_job)."""

    registry_name: str
    """The replica pool's name: a job attaches to it, waiting while it boots."""
    lease_generation: int
    """The run's lease on the folder: a job's commits stop if a later run takes it."""
    progress_board: str
    """The run's ProgressBoard: a job reports its counts there and hears a stop request."""


@dataclass(frozen=True)
class ShardEnded:
    """A shard job that has ended, as its submitter reports it."""

    shard: ShardSpec
    marker: SuccessMarker | None
    """Its marker when it finished; None when it did not."""
    failure: str | None = None
    """Why it did not finish, in one line (a failure once its retries are spent, or a stop: the
    driver counts it as a failure only while the run is not stopping)."""


class ShardSubmitter(Protocol):
    """How a run's shard jobs reach workers. A context manager: entering it makes the run's Ray
    reachable (the progress board is a Ray actor); leaving it ends what it started."""

    def __enter__(self) -> ShardSubmitter: ...

    def __exit__(self, *exc_info: Any) -> None: ...

    def submit(self, job: ShardJobArgs) -> list[SuccessMarker]:
        """Start (or queue) a job for every shard of the plan; answers the markers of shards
        known to be finished already, without running anything (the display counts them done)."""
        ...

    def next_ended(self, timeout: float) -> ShardEnded | None:
        """The next shard job to end, or None when none ended within `timeout` seconds. A
        submitter may raise a shard job's error here instead (the in-process one does): the run
        then ends with it, its replicas stopped and its lease released."""
        ...

    def pending(self) -> int:
        """Shard jobs submitted whose end `next_ended` has not answered yet."""
        ...

    def stop(self, started: set[int]) -> None:
        """The run is stopping: cancel the jobs of the shards not in `started` (the others stop
        themselves after their last commit) and retry nothing."""
        ...


Finish = Callable[[RunPlan, list[SuccessMarker], float, LeaseFence], dict[str, Any]]
"""Merge and write manifest.json: (plan, markers, elapsed seconds, fence) -> the summary."""
Publish = Callable[[RunPlan, dict[str, Any], list[SuccessMarker], LeaseFence], dict[str, Any]]
"""Publish: (plan, summary, markers, fence) -> the summary with what was published."""


def publish_summary(
    plan: RunPlan, summary: dict[str, Any], markers: list[SuccessMarker], fence: LeaseFence
) -> dict[str, Any]:
    """The library's publish (no Prefect UI to fill): zip, report, metrics, W&B artifact."""
    return dict(summary, published=publish_run(plan.cfg, plan.folder, summary, fence=fence, settings=plan.settings))


def stopped_message(plan: RunPlan) -> str:
    """What a run stopped by a Ctrl-C leaves: the trajectories committed, and how to go on."""
    counts = committed_counts(plan.folder, [s.shard_id for s in plan.shards])
    return f"stopped on request: {sum(counts.values()):,} trajectories committed in {plan.folder.display()}; run the same command again to resume"


def boot_words(layout: ReplicaLayout) -> str:
    """What the terminal says while the replicas start: the instant engine (tests, benchmarks)
    loads no model, and remote servers are running already."""
    if layout.engine == "instant":
        return f"starting {layout.describe()} (no model to load), then the first requests"
    if layout.engine == REMOTE_ENGINE:
        return f"connecting to {layout.describe()}, then the first requests"
    return f"starting {layout.describe()}: loading the model, then the first requests"


def boot_pool(plan: RunPlan, registry_name: str) -> ReplicaPool:
    """Boot the run's replicas (once per run); the caller tears them down."""
    failpoint("boot_pool")
    return asyncio.run(ReplicaPool.boot(plan.cfg, registry_name))


def _prefix_cache_report(pool: ReplicaPool) -> dict[str, Any] | None:
    """The replicas' prefix-cache hit rates, logged, for the run's summary (None: not counted)."""
    try:
        report = asyncio.run(pool.prefix_cache_report())
    except Exception as exc:  # noqa: BLE001 - a replica that died already said so; the run goes on
        logger.warning("could not read the replicas' prefix-cache counters: %s", exc)
        return None
    if report is not None:
        replicas = ", ".join("-" if rate is None else f"{rate:.0%}" for rate in report["replicas"])
        logger.info(
            "prefix cache: %.0f%% of prompt tokens reused (per replica: %s)", 100 * (report["run"] or 0.0), replicas
        )
    return report


def drive_run(
    plan: RunPlan,
    submitter: ShardSubmitter,
    *,
    started: float,
    finish: Finish = finish_run,
    publish: Publish = publish_summary,
    on_progress: Callable[[ProgressTotals], None] | None = None,
    on_stall: Callable[[Stall], None] | None = None,
) -> dict[str, Any] | None:
    """Generate every missing trajectory, merge, publish: the run's summary, or None when a
    Ctrl-C stopped the run (what is committed stays; the lease is released). `started`: when the
    run began (time.perf_counter()), for the summary's elapsed time. `on_progress`: the progress
    numbers every few seconds (the Prefect progress artifact); `on_stall`: the stall alarm, once
    per stall (stall_alarm.py; the terminal line is the driver's own)."""
    # Replicas the run's Ray cannot hold are refused before the lease and run.json are written:
    # the corrected command then finds the folder as it was.
    check_replicas_fit(plan.cfg)
    try:
        # One run per output folder: a second run on it is refused here, before any model loads.
        with RunLease.acquire(plan.folder, plan.settings.lease_seconds) as lease:
            plan.claim_folder()
            return _drive_holding(plan, submitter, lease.fence(), started, finish, publish, on_progress, on_stall)
    except Stopped:
        # A Ctrl-C while waiting for the lease, booting replicas, merging or publishing
        # (STOP.interruptible): that stage ended at once, the lease is released on the way out.
        return None


def _drive_holding(
    plan: RunPlan,
    submitter: ShardSubmitter,
    fence: LeaseFence,
    started: float,
    finish: Finish,
    publish: Publish,
    on_progress: Callable[[ProgressTotals], None] | None,
    on_stall: Callable[[Stall], None] | None = None,
) -> dict[str, Any] | None:
    markers: list[SuccessMarker] = []
    failures: list[str] = []
    with submitter, RunWatch(plan, on_update=on_progress, on_stall=on_stall) as watch:
        mark("ray_ready")
        # Shard jobs first: where they run beside the driver, their workers start (imports,
        # tokenizer, prompts) while the replicas load, and each waits for the pool by name.
        registry_name = new_registry_name()
        job = ShardJobArgs(
            registry_name=registry_name, lease_generation=fence.generation, progress_board=watch.board_name
        )
        for marker in submitter.submit(job):
            watch.shard_finished(marker)
        try:
            # Minutes for SGLang: a Ctrl-C ends the boot at once (Ray's shutdown stops the replicas).
            starting = boot_words(resolve_layout(plan.cfg))
            with prints_to_debug_log("verl"), STOP.interruptible(), watch.display.while_waiting(starting):
                pool = boot_pool(plan, registry_name)
        except BaseException:
            submitter.stop(set())
            raise
        mark("engine_ready")
        watch.watch_engines(pool)
        try:
            stopping = _until_every_shard_ended(submitter, watch, markers, failures)
        finally:
            prefix_cache = _prefix_cache_report(pool)
            pool.shutdown()
    if stopping or STOP.requested():
        return None
    if failures:
        raise ShardsFailed(
            f"{len(failures)} of {len(plan.shards)} shards failed (generation.retries={plan.settings.retries}): {'; '.join(failures)}; "
            "committed trajectories are kept, run the same command again to resume"
        )
    markers.sort(key=lambda m: m.shard_id)
    # Every shard is committed: a Ctrl-C ends the merge or the publish at once, and the same
    # command does them again (the merged files are written whole or not at all).
    with STOP.interruptible():
        summary = finish(plan, markers, time.perf_counter() - started, fence)
        if prefix_cache is not None:
            summary = dict(summary, prefix_cache=prefix_cache)
        mark("merged")
        return publish(plan, summary, markers, fence)


def _until_every_shard_ended(
    submitter: ShardSubmitter, watch: RunWatch, markers: list[SuccessMarker], failures: list[str]
) -> bool:
    """Watch the shard jobs until every one ended (or, after a first Ctrl-C, until they stopped
    or STOP_GRACE_SECONDS passed), collecting their success markers and failures; whether the
    run is stopping."""
    stopping, stop_deadline = False, float("inf")
    while submitter.pending() and time.monotonic() < stop_deadline:
        watch.tick()
        if STOP.requested() and not stopping:
            # A first Ctrl-C: no new shard starts; running shard jobs commit what has
            # finished and stop (ShardStopped).
            stopping, stop_deadline = True, time.monotonic() + STOP_GRACE_SECONDS
            submitter.stop(watch.stop())
        ended = submitter.next_ended(TICK_SECONDS)
        if ended is None:
            continue
        if ended.marker is not None:
            watch.shard_finished(ended.marker)
            markers.append(ended.marker)
        elif ended.failure is not None and not stopping:
            failures.append(ended.failure)
    if submitter.pending():
        logger.warning(
            "%d shard job(s) did not stop within %.0f s; Ray's shutdown stops them",
            submitter.pending(),
            STOP_GRACE_SECONDS,
        )
    return stopping
