"""The stall alarm: a run that neither commits a trajectory nor generates a token for
`generation.stall_seconds` says so, once, while it goes on waiting.

A run that stalls silently for hours is the complaint (a step that logged nothing for 14 minutes
with requests queued). The driver's `RunWatch` hands `StallWatch.observe` what moves while a run
works: each running shard's counters from the progress board (trajectories generated and
committed, per attempt) and the engines' generated-token counters (genrun's own engines report
them; for verl's replicas the trajectories alone decide). When nothing moved for stall_seconds
the alarm goes off once: a warning line in the terminal and the dispatcher's `on_stall` (the
flow: a Prefect log entry and a markdown artifact; `drive_run(on_stall=...)`: any callable given
the `Stall`, e.g. one that alerts the caller's tracker). Progress afterwards re-arms it (and says
so). `genrun status DIR` finds the same from the run folder alone (outputs/status.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from generation_core.shard.eta import format_seconds

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stall:
    """A run that made no progress for `seconds` (at least generation.stall_seconds)."""

    since: float
    """Unix time of the last progress seen (or of the watch's start: nothing moved since)."""
    seconds: float
    shards: tuple[str, ...]
    """The shards running (started, not finished): none of them made progress."""

    def message(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        shards = ", ".join(self.shards) if self.shards else "none running"
        return (
            f"stalled: no trajectory committed and no token generated for {format_seconds(self.seconds)} (since {since}); "
            f"shards concerned: {shards}. The run goes on waiting; a replica that stopped answering is the usual cause "
            "(generation.stall_seconds sets when this is said)"
        )


@dataclass
class StallWatch:
    """Says when nothing moved for `stall_seconds`: `observe` answers a `Stall` once per stall."""

    stall_seconds: float
    clock: Callable[[], float] = time.time
    _run_signal: Hashable = field(init=False, default=None)
    _tokens: int | None = field(init=False, default=None)
    _last_change: float | None = field(init=False, default=None)
    alarm: Stall | None = field(init=False, default=None)
    """The stall now going on (None: none, or progress since)."""

    def observe(self, shards: Mapping[str, Hashable], engine_tokens: int | None = None) -> Stall | None:
        """`shards`: each running shard's progress counters (anything comparable: a change is
        progress); `engine_tokens`: tokens the engines generated so far (None: not known).
        Answers a new stall the first time one is seen, else None."""
        now = self.clock()
        counters = tuple(sorted(shards.items()))
        tokens_moved = engine_tokens is not None and self._tokens is not None and engine_tokens != self._tokens
        if engine_tokens is not None:
            self._tokens = engine_tokens  # the first count known is no progress, only a baseline
        if self._last_change is None or counters != self._run_signal or tokens_moved:
            if self.alarm is not None:
                logger.warning(
                    "progress again after %s without any: the stall is over", format_seconds(now - self.alarm.since)
                )
            self._run_signal, self._last_change, self.alarm = counters, now, None
        if self.alarm is not None or now - self._last_change < self.stall_seconds:
            return None
        # Any shard's counter moving is progress of the run: every shard running now is quiet.
        self.alarm = Stall(since=self._last_change, seconds=now - self._last_change, shards=tuple(sorted(shards)))
        return self.alarm


def raise_alarm(stall: Stall, on_stall: Callable[[Stall], None] | None) -> None:
    """Every place the alarm goes: the terminal, then the dispatcher's `on_stall` (the flow: a
    Prefect log entry and artifact; a library caller's own: its tracker). Neither may fail the run."""
    logger.warning("%s", stall.message())
    if on_stall is not None:
        try:
            on_stall(stall)
        except Exception as exc:  # noqa: BLE001 - an alarm that cannot be shown must not stop the run
            logger.warning("could not pass on the stall alarm (%s: %s)", type(exc).__name__, exc)
