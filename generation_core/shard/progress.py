"""A shard job's end of the run's progress: its counters, and the stop request that comes back.

Shard jobs run in Ray workers whose output never reaches the terminal, so each job reports its
counters, about once a second, to one named Ray actor of the run (progress_board.py): what its
shard had committed when the attempt started, what it has generated, committed and failed
since, what it owes. The driver reads the board (driver/run_progress.py).

The board's answers carry the driver's stop request (a first Ctrl-C) to the shard jobs: each job
sees it at its next report, commits what has finished and raises `ShardStopped`; and each job's
share of the run's in-flight budget (progress_board.py), which its stream's limits follow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

REPORT_SECONDS = 1.0
"""How often a shard job reports to the board (and learns of a stop request)."""
BOARD_TIMEOUT_SECONDS = 10.0
"""The longest a shard job waits for the board's answer (a board that never started must not
hold a shard up)."""


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
