"""A run's progress across its shards, and the stop request that goes the other way.

Shard jobs run in Ray workers whose output never reaches the terminal, so each job reports its
counters, about once a second, to one named Ray actor of the run (`ProgressBoard`): what its
shard had committed when the attempt started, what it has generated, committed and failed
since, what it owes. The driver reads the board and adds what it knows without it (shards that
finished, what an earlier run committed in shards no job has started yet: `committed_counts`)
into `RunProgress`: trajectories done / total, rate, ETA (shard/eta.py), failures. The same numbers feed the
terminal and the flow run's Prefect progress artifact.

The board also carries the driver's stop request (a first Ctrl-C) to the shard jobs: each job
sees it at its next report, commits what has finished and raises `ShardStopped`; and each job's
share of the run's in-flight budget (progress_board.py), which its stream's limits follow.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from generation_core.run_plan import ShardSpec
from generation_core.shard.eta import Durations, EtaTrace, ShardPace, cost_to_go, estimate_eta, format_seconds
from generation_core.shard.progress_board import ProgressBoard
from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import shard_name

logger = logging.getLogger(__name__)

REPORT_SECONDS = 1.0
"""How often a shard job reports to the board (and learns of a stop request)."""
BOARD_TIMEOUT_SECONDS = 10.0
"""The longest a shard job waits for the board's answer (a board that never started must not
hold a shard up)."""
RATE_WINDOW_SECONDS = 60.0
"""The rate shown is measured over the generation of the last minute (the ETA's is not: eta.py)."""
PROGRESS_BOARD_PREFIX = "genrun_progress"


class ShardStopped(RuntimeError):
    """The run was asked to stop: the shard job committed what had finished and stopped. Not a
    failure: nothing is retried, the next run resumes the shard."""


@dataclass
class ShardReport:
    """What one attempt at a shard has done so far (one report replaces the previous one)."""

    shard_id: int
    attempt: str
    """A token per attempt: the generated counts of a shard's attempts add up."""
    committed_at_start: int
    owed: int
    """Trajectories the shard owes at most (rows x n, less prompts found too long so far)."""
    generated: int = 0
    committed: int = 0
    failed: int = 0
    sent: float = 0.0
    """Unix time the job sent it (0: unknown): the ETA's rates count to when the counts were true,
    not to when the driver happened to read them (up to two report periods later)."""
    ended: bool = False
    """The attempt's last report: its job generates no more (the board's in-flight shares)."""
    open_now: int = 0
    """Trajectories the job has in flight (started, not finished): the ETA's drain."""
    durations: dict[int, int] = field(default_factory=dict)
    """How long this attempt's finished trajectories took (eta.Durations' histogram)."""


def new_board_name() -> str:
    return f"{PROGRESS_BOARD_PREFIX}_{uuid.uuid4().hex[:8]}"


def start_board(name: str):
    """The run's board, a named actor of the caller's Ray namespace (it holds no CPU)."""
    import ray

    return ray.remote(ProgressBoard).options(name=name, num_cpus=0).remote()


class ShardReporter:
    """A shard job's end of the board: counters it bumps as trajectories finish, sent once a
    second by `reporting()`; `stop` turns True once the driver asked the run to stop. Without a
    board (library use, the in-process dispatcher) it counts and never stops."""

    def __init__(self, board: Any, shard_id: int):
        self.board = board
        self.report = ShardReport(shard_id=shard_id, attempt=uuid.uuid4().hex, committed_at_start=0, owed=0)
        self.stop = False
        self.share = 1.0
        """This job's share of the run's in-flight budget, as the board last answered
        (progress_board.py): 1.0 while every worker has a shard, more once some finished."""
        self.durations = Durations(self.report.durations)
        """How long its trajectories took (the report's histogram): the driver's ETA adds the
        drain of those still open (shard/eta.py)."""

    @classmethod
    def attach(cls, board_name: str | None, shard_id: int) -> ShardReporter:
        board = None
        if board_name:
            import ray

            try:
                board = ray.get_actor(board_name)
            except ValueError:
                # Progress is for the person watching: a run without it still generates.
                logger.warning("progress board %r is not running; shard %d reports no progress", board_name, shard_id)
        return cls(board, shard_id)

    def finished(self, generated: int, provenance: dict[str, Any] | None) -> None:
        """A trajectory finished: `generated` this attempt now; its provenance says when it started."""
        self.report.generated = generated
        started_at = (provenance or {}).get("started_at")
        if started_at is not None:
            self.durations.add(time.time() - float(started_at))

    @property
    def attached(self) -> bool:
        return self.board is not None

    def stop_requested_now(self) -> bool:
        """Ask the board once, blocking (a job about to start its work)."""
        if self.board is None:
            return False
        import ray

        try:
            self.stop = self.stop or bool(
                ray.get(self.board.stop_requested.remote(self.report.shard_id), timeout=BOARD_TIMEOUT_SECONDS)
            )
        except Exception as exc:  # noqa: BLE001 - the board is cosmetic except for stopping; go on without it
            logger.warning("could not reach the progress board (%s: %s)", type(exc).__name__, exc)
        return self.stop

    async def send(self) -> None:
        if self.board is None:
            return
        self.report.sent = time.time()
        try:
            answer = await asyncio.wait_for(self.board.report.remote(asdict(self.report)), BOARD_TIMEOUT_SECONDS)
            self.stop = bool(answer["stop"]) or self.stop
            self.share = max(1.0, float(answer["share"]))
        except Exception as exc:  # noqa: BLE001 - a missed report only delays the display
            logger.debug("progress report failed: %s: %s", type(exc).__name__, exc)

    @contextlib.asynccontextmanager
    async def reporting(self) -> AsyncIterator[ShardReporter]:
        """Report every REPORT_SECONDS while the block runs, and once more at its end."""

        async def loop() -> None:
            while True:
                await self.send()
                await asyncio.sleep(REPORT_SECONDS)

        self.report.ended = False  # a second round (adaptive sampling) reports again
        task = asyncio.ensure_future(loop()) if self.board is not None else None
        try:
            yield self
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                self.report.ended = True
                await self.send()


def committed_counts(folder: StorageFolder, shard_ids: Iterable[int], threads: int = 16) -> dict[int, int]:
    """Trajectories each shard has committed, from its commit records (the source of truth)."""
    ids = list(shard_ids)

    def count(shard_id: int) -> int:
        return len(set(ShardCheckpoint.load(folder, shard_name(shard_id)).completed))

    if folder.is_local or len(ids) < 2:
        return {shard_id: count(shard_id) for shard_id in ids}
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(ids, pool.map(count, ids), strict=True))


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
    cost_to_go: float | None = None
    """What the ETA's seconds cost at `generation.gpu_hour_price` (None: no price set, no ETA)."""

    @property
    def percent(self) -> float:
        return 100.0 if self.total <= 0 else min(100.0, 100.0 * (self.done + self.failed) / self.total)

    def line(self) -> str:
        parts = [f"trajectories {self.done:,}/{self.total:,} ({self.percent:.1f}%)"]
        if self.done + self.failed < self.total:
            parts.append(f"{self.rate:.1f}/s" if self.rate is not None else "-/s")
            parts.append(f"ETA {format_seconds(self.eta)}" if self.eta is not None else "ETA -")
            if self.cost_to_go is not None:
                parts[-1] += f" (~{self.cost_to_go:.3g} to go)"
        else:
            parts.append(
                f"{self.rate:.1f}/s in {format_seconds(self.elapsed)}"
                if self.rate is not None
                else f"in {format_seconds(self.elapsed)}"
            )
        parts.append(f"{self.failed:,} failed")
        parts.append(f"shards {self.shards_done}/{self.shards} done")
        return ", ".join(parts)


@dataclass
class _Shard:
    expected: int
    baseline: int | None = None
    report: ShardReport | None = None
    finished: tuple[int, int, int] | None = None
    """(done, failed, expected) from the shard's manifest."""
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
    devices: int = 1
    """GPUs the run holds (a CPU replica counts as one): the cost to go's multiplier."""
    gpu_hour_price: float | None = None
    trace: EtaTrace = field(default_factory=EtaTrace)
    """The ETAs shown, for the finished run's predicted-vs-actual (shard/eta.py)."""
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

    def shard_finished(self, shard_id: int, done: int, failed: int, expected: int) -> None:
        self._state[shard_id].finished = (done, failed, expected)

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
                open_now=s.report.open_now,
            )
            for s in self._state.values()
            if s.report is not None and s.finished is None and s.started is not None
        ]
        # The running shards' durations (one engine, one distribution; a finished shard's would
        # cost every tick a merge on a run of thousands of shards).
        durations = Durations()
        for shard in self._state.values():
            if shard.report is not None and shard.finished is None:
                durations.merge(shard.report.durations)
        eta = estimate_eta(remaining, self._generated - generated_then, self._generated_at - since, paces, durations)
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
        eta = self._eta(remaining, now)
        if self._generating_since is not None:
            self.trace.add(now - self._generating_since[0], done + failed, total, eta)
        return ProgressTotals(
            done=done,
            failed=failed,
            total=total,
            shards_done=shards_done,
            shards=len(self._state),
            generated=self._generated,
            elapsed=now - self._started,
            rate=rate,
            eta=eta,
            cost_to_go=cost_to_go(eta, self.devices, self.gpu_hour_price) if remaining else None,
        )
