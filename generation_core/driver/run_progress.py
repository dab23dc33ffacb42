"""The driver's view of a run's progress across its shards.

Shard jobs run in Ray workers whose output never reaches the terminal, so each job reports its
counters, about once a second, to one named Ray actor of the run (shard/progress_board.py,
through shard/progress.py's `ShardReporter`). The driver reads the board and adds what it knows
without it (shards that finished, what an earlier run committed in shards no job has started
yet: `committed_counts`) into `RunProgress`: trajectories done / total, rate, ETA
(shard/eta.py), failures. The same numbers feed the terminal and the flow run's Prefect progress
artifact.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from generation_core.run_plan import ShardSpec
from generation_core.shard.eta import ShardPace, estimate_eta, format_seconds
from generation_core.shard.progress import ShardReport
from generation_core.shard.progress_board import ProgressBoard
from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import shard_name

RATE_WINDOW_SECONDS = 60.0
"""The rate shown is measured over the generation of the last minute (the ETA's is not: eta.py)."""
PROGRESS_BOARD_PREFIX = "genrun_progress"


def new_board_name() -> str:
    return f"{PROGRESS_BOARD_PREFIX}_{uuid.uuid4().hex[:8]}"


def start_board(name: str):
    """The run's board, a named actor of the caller's Ray namespace (it holds no CPU)."""
    import ray

    return ray.remote(ProgressBoard).options(name=name, num_cpus=0).remote()


def committed_counts(folder: StorageFolder, shard_ids: Iterable[int], threads: int = 16) -> dict[int, int]:
    """Trajectories each shard has committed, from its commit records (the source of truth)."""
    ids = list(shard_ids)

    def count(shard_id: int) -> int:
        return len(set(ShardCheckpoint.load(folder, shard_name(shard_id)).completed))

    if folder.is_local or len(ids) < 2:
        return {shard_id: count(shard_id) for shard_id in ids}
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(ids, pool.map(count, ids), strict=True))


def rate_text(rate: float) -> str:
    """A rate in trajectories/s: two decimals below 1/s (0.34, not 0.3), one above."""
    return f"{rate:.2f}" if rate < 1 else f"{rate:.1f}"


@dataclass
class ProgressTotals:
    done: int
    failed: int
    total: int
    shards_done: int
    shards: int
    generated: int
    """Trajectories this invocation generated (all shards, all attempts)."""
    elapsed: float
    rate: float | None
    """Trajectories per second over the last RATE_WINDOW_SECONDS (None: not measurable yet)."""
    eta: float | None
    """Seconds left: shard/eta.py's estimate from the rate since generation started and each
    running shard's rows left (None: not measurable yet)."""
    not_needed: int = 0
    """Samples adaptive sampling decided not to draw, in finished shards (their markers' not_owed):
    `total` no longer counts them."""

    @property
    def percent(self) -> float:
        return 100.0 if self.total <= 0 else min(100.0, 100.0 * (self.done + self.failed) / self.total)

    def line(self) -> str:
        drawn = " drawn" if self.not_needed else ""
        parts = [f"trajectories {self.done:,}/{self.total:,}{drawn} ({self.percent:.1f}%)"]
        if self.not_needed:
            parts.append(f"{self.not_needed:,} not needed (adaptive sampling)")
        if self.done + self.failed < self.total:
            parts.append(f"{self.rate:.1f}/s" if self.rate is not None else "-/s")
            parts.append(f"ETA {format_seconds(self.eta)}" if self.eta is not None else "ETA -")
        elif self.generated and self.elapsed > 0:
            # The whole run's average beside the whole run's time (the running rate is the last minute's).
            parts.append(f"{rate_text(self.generated / self.elapsed)}/s on average over {format_seconds(self.elapsed)}")
        else:
            parts.append(f"in {format_seconds(self.elapsed)}")
        parts.append(f"{self.failed:,} failed")
        parts.append(f"shards {self.shards_done}/{self.shards} done")
        return ", ".join(parts)


@dataclass
class _Shard:
    expected: int
    baseline: int | None = None
    report: ShardReport | None = None
    finished: tuple[int, int, int] | None = None
    """(done, failed, expected) from the shard's marker."""
    not_needed: int = 0
    """Its marker's not_owed (adaptive sampling)."""
    started: tuple[str, float, int] | None = None
    """(attempt, when its first report was sent, what it had generated then): its own rate."""
    reported_at: float = 0.0
    """When its latest report was sent (on RunProgress's clock)."""


@dataclass
class RunProgress:
    """The driver's view of a run's progress, from the plan, the run folder and the board."""

    shards: list[ShardSpec]
    rollout_n: int
    clock: Any = time.monotonic
    _state: dict[int, _Shard] = field(init=False)
    _samples: collections.deque = field(init=False)
    _generated: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._state = {s.shard_id: _Shard(expected=(s.end - s.start) * self.rollout_n) for s in self.shards}
        self._started = self.clock()
        self._samples = collections.deque([(self._started, 0)])
        self._generating_since: tuple[float, int] | None = None
        self._generated_at: float | None = None

    def set_baseline(self, counts: dict[int, int]) -> None:
        """What each shard had committed before this invocation (committed_counts)."""
        for shard_id, count in counts.items():
            if shard_id in self._state:
                self._state[shard_id].baseline = count

    def resume_line(self) -> str | None:
        """What a resumed run says before it generates: the trajectories earlier runs committed
        (set_baseline); None for a run that starts from nothing."""
        committed = sum(s.baseline or 0 for s in self._state.values())
        if not committed:
            return None
        planned = sum(s.expected for s in self._state.values())
        return (
            f"resuming: {committed:,} of {planned:,} trajectories already committed in this folder "
            "(kept; only the others are generated)"
        )

    def shard_finished(self, shard_id: int, done: int, failed: int, expected: int, not_needed: int = 0) -> None:
        self._state[shard_id].finished = (done, failed, expected)
        self._state[shard_id].not_needed = not_needed

    def update(self, snapshot: dict[str, Any]) -> None:
        """Take a board snapshot (ProgressBoard.snapshot)."""
        now = self.clock()
        newest = None
        for payload in snapshot.get("reports", []):
            report = ShardReport(**payload)
            if report.shard_id in self._state:
                shard = self._state[report.shard_id]
                shard.report = report
                # When the report was true, on this progress's clock.
                shard.reported_at = now - max(0.0, time.time() - report.sent) if report.sent else now
                newest = shard.reported_at if newest is None else max(newest, shard.reported_at)
                if shard.started is None or shard.started[0] != report.attempt:
                    shard.started = (report.attempt, shard.reported_at, report.generated)
        if newest is not None:
            self._generated_at = newest  # the board's total was true then (unchanged counts too)
        self._generated = max(self._generated, int(snapshot.get("generated", 0)))
        if self._generating_since is None and newest is not None:
            # The ETA's rate counts from the first shard at work, not from the replicas' boot.
            self._generating_since = (newest, self._generated)
        self._samples.append((now, self._generated))
        # The window starts at the last moment nothing had been generated yet (workers still
        # starting) or RATE_WINDOW_SECONDS ago, whichever is later.
        while len(self._samples) > 2 and (
            now - self._samples[1][0] >= RATE_WINDOW_SECONDS or self._samples[1][1] == self._samples[0][1]
        ):
            self._samples.popleft()

    def _eta(self, remaining: int, now: float) -> float | None:
        """estimate_eta over the run's rate since its first shard reported and each running
        shard's rate since its attempt's first report, each to when its counts were sent; less
        the time since then."""
        if remaining == 0:
            return 0.0
        if self._generating_since is None or self._generated_at is None:
            return None
        since, generated_then = self._generating_since
        paces = [
            ShardPace(
                remaining=max(s.report.owed - s.report.committed_at_start - s.report.generated - s.report.failed, 0),
                done=s.report.generated - s.started[2],
                seconds=s.reported_at - s.started[1],
            )
            for s in self._state.values()
            if s.report is not None and s.finished is None and s.started is not None
        ]
        eta = estimate_eta(remaining, self._generated - generated_then, self._generated_at - since, paces)
        return None if eta is None else max(eta - (now - self._generated_at), 0.0)

    def activity(self) -> dict[str, tuple[str, int, int]]:
        """Each running shard's (attempt, generated, committed): what the stall alarm watches."""
        return {
            shard_name(shard_id): (s.report.attempt, s.report.generated, s.report.committed)
            for shard_id, s in self._state.items()
            if s.report is not None and s.finished is None
        }

    def totals(self) -> ProgressTotals:
        done = failed = total = shards_done = 0
        for shard in self._state.values():
            if shard.finished is not None:
                shard_done, shard_failed, expected = shard.finished
                shards_done += 1
            elif shard.report is not None:
                report = shard.report
                shard_done, shard_failed, expected = (
                    report.committed_at_start + report.generated,
                    report.failed,
                    report.owed,
                )
            else:
                shard_done, shard_failed, expected = shard.baseline or 0, 0, shard.expected
            done, failed, total = done + shard_done, failed + shard_failed, total + expected
        now = self.clock()
        first_time, first_generated = self._samples[0]
        span = now - first_time
        rate = (self._generated - first_generated) / span if span >= 2.0 and self._generated > first_generated else None
        remaining = max(total - done - failed, 0)
        return ProgressTotals(
            done=done,
            failed=failed,
            total=total,
            shards_done=shards_done,
            shards=len(self._state),
            generated=self._generated,
            elapsed=now - self._started,
            rate=rate,
            eta=self._eta(remaining, now),
            not_needed=sum(s.not_needed for s in self._state.values() if s.finished is not None),
        )
