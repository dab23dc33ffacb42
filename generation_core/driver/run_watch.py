"""The driver's side of a running run: the progress board its shard jobs report to, the progress
display, periodic progress updates for elsewhere (the Prefect artifact), and the stop request.

A dispatcher opens one `RunWatch` per run, passes `board_name` to its shard jobs, calls
`tick()` while it waits for them (a non-blocking read of the board), `shard_finished()` as
their markers arrive, and `stop()` on a Ctrl-C: the shard jobs see the request within about
a second, commit what has finished and stop. `tick()` also feeds the stall alarm
(stall_alarm.py): the shards' counters and, once `watch_engines` gave it the replica pool, the
engines' generated-token counters, read without blocking.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from generation_core.console import ProgressDisplay
from generation_core.driver.run_progress import (
    ProgressTotals,
    RunProgress,
    committed_counts,
    new_board_name,
    start_board,
)
from generation_core.driver.stall_alarm import Stall, StallWatch, raise_alarm
from generation_core.run_plan import RunPlan
from generation_core.store.run_folder import SuccessMarker

logger = logging.getLogger(__name__)

UPDATE_SECONDS = 10.0
"""How often `on_update` (the Prefect progress artifact) gets the numbers; the display redraws
more often."""
ENGINE_POLL_SECONDS = 5.0
"""How often the engines' token counters are asked for (for the stall alarm)."""


class RunWatch:
    def __init__(
        self,
        plan: RunPlan,
        *,
        on_update: Callable[[ProgressTotals], None] | None = None,
        update_seconds: float = UPDATE_SECONDS,
        on_stall: Callable[[Stall], None] | None = None,
    ):
        gen = plan.settings
        self.stall_watch = StallWatch(float(gen.stall_seconds or float("inf")))
        self.on_stall = on_stall
        self._pool: Any = None
        self._health_refs: list[Any] | None = None
        self._last_poll = float("-inf")
        self.engine_tokens: int | None = None
        self._watching_since: float | None = None
        """When the stall alarm began watching: once a shard job reported (it is generating)."""
        self.plan = plan
        self.progress = RunProgress(plan.shards, plan.cfg.actor_rollout_ref.rollout.n)
        self.display = ProgressDisplay(enabled=bool(gen.show_progress), interval=float(gen.progress_seconds))
        self.on_update, self.update_seconds = on_update, update_seconds
        self.board_name = new_board_name()
        self.board = start_board(self.board_name)
        self._snapshot_ref = None
        self._last_update = time.monotonic()
        self._reported: set[int] = set()

    def __enter__(self) -> RunWatch:
        self.display.__enter__()
        # What earlier runs committed in shards no job has reported yet: read in the background
        # (a listing and the commit records per shard; many shards on S3 take a while).
        threading.Thread(target=self._load_baseline, name="genrun-progress-baseline", daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _load_baseline(self) -> None:
        try:
            self.progress.set_baseline(committed_counts(self.plan.folder, [s.shard_id for s in self.plan.shards]))
            resuming = self.progress.resume_line()
            if resuming:
                logger.info(resuming)
        except Exception as exc:  # noqa: BLE001 - the display then counts those shards from their reports
            logger.debug("could not count committed trajectories for the progress display: %s", exc)

    def shard_finished(self, marker: SuccessMarker) -> None:
        self.progress.shard_finished(
            marker.shard_id, marker.num_trajectories, marker.failures, marker.expected_trajectories, marker.not_owed
        )

    def reported_shards(self) -> set[int]:
        """Shards whose job has started generating (and so will see a stop request itself)."""
        return set(self._reported)

    def _take_snapshot(self, timeout: float = 0) -> None:
        """Fold in the board's answer to the last snapshot request, if it came within `timeout`."""
        if self._snapshot_ref is None:
            return
        ready, _ = ray.wait([self._snapshot_ref], timeout=timeout)
        if not ready:
            return
        try:
            snapshot = ray.get(self._snapshot_ref)
        except Exception as exc:  # noqa: BLE001 - the display is cosmetic; ask again
            logger.debug("progress board snapshot failed: %s", exc)
        else:
            self._reported.update(r["shard_id"] for r in snapshot.get("reports", []))
            self.progress.update(snapshot)
        self._snapshot_ref = None

    def tick(self) -> ProgressTotals:
        """Take the board's latest snapshot if it has answered, show the numbers."""
        self._take_snapshot()
        if self._snapshot_ref is None:
            self._snapshot_ref = self.board.snapshot.remote()
        totals = self.progress.totals()
        self.display.show(totals.line())
        self._watch_stall()
        if self.on_update is not None and time.monotonic() - self._last_update >= self.update_seconds:
            self._update(self.on_update, totals)
        return totals

    def watch_engines(self, pool: Any) -> None:
        """The booted replica pool (serving.pool.ReplicaPool): its engines' token counters join
        what the stall alarm watches."""
        self._pool = pool

    def _poll_engines(self) -> None:
        if self._health_refs is not None:
            ready, _ = ray.wait(self._health_refs, num_returns=len(self._health_refs), timeout=0)
            if len(ready) < len(self._health_refs):
                return
            try:
                self.engine_tokens = sum(int(h.get("generated_tokens", 0)) for h in ray.get(self._health_refs))
            except Exception as exc:  # noqa: BLE001 - a replica restarting: the trajectories still count
                logger.debug("engine counters unavailable: %s", exc)
            self._health_refs = None
        if self._pool is not None and time.monotonic() - self._last_poll >= ENGINE_POLL_SECONDS:
            self._last_poll = time.monotonic()
            self._health_refs = self._pool.health_requests() or None

    def _watch_stall(self) -> None:
        running = self.progress.activity()
        if self._pool is None or (not running and self.stall_watch.alarm is None and self._watching_since is None):
            return  # replicas booting, shard workers starting (imports, prompts): no stall yet
        self._watching_since = self._watching_since or time.monotonic()
        self._poll_engines()
        stall = self.stall_watch.observe(running, self.engine_tokens)
        if stall is not None:
            raise_alarm(stall, self.on_stall)

    def _update(self, on_update: Callable[[ProgressTotals], None], totals: ProgressTotals) -> None:
        self._last_update = time.monotonic()
        try:
            on_update(totals)
        except Exception as exc:  # noqa: BLE001 - progress reporting must never fail a run
            logger.warning("could not update the run's progress (%s: %s)", type(exc).__name__, exc)

    def stop(self) -> set[int]:
        """Ask every shard job to commit what has finished and stop. Answers the shards whose
        jobs had started by then: they stop themselves, after their last commit, and must not
        be cancelled; any other job sees the request before it generates anything."""
        try:
            return set(ray.get(self.board.request_stop.remote(), timeout=30))
        except Exception as exc:  # noqa: BLE001 - shard jobs are then stopped by Ray's shutdown
            logger.warning("could not pass the stop request to the shard jobs (%s: %s)", type(exc).__name__, exc)
            # The jobs cannot hear it either: those seen generating are left to the grace period.
            return self.reported_shards()

    def close(self) -> ProgressTotals:
        """The final numbers: shown once more, sent to `on_update`, the board stopped."""
        # The shard jobs' last reports (after their last commits), unless the board is gone.
        try:
            self._take_snapshot(timeout=2)
            self._snapshot_ref = self.board.snapshot.remote()
            self._take_snapshot(timeout=5)
        except Exception as exc:  # noqa: BLE001 - Ray already shut down: the last numbers seen
            logger.debug("no final progress snapshot: %s", exc)
        totals = self.progress.totals()
        self.display.close(totals.line())
        if self.on_update is not None:
            self._update(self.on_update, totals)
        try:
            ray.kill(self.board, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - it goes with the Ray job anyway
            logger.debug("could not stop the progress board: %s", exc)
        return totals
