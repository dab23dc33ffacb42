"""A run's ETA from its rate and the rows each shard has left.

Two bounds, the later one wins:
- the run's: every trajectory left, at the run's rate since generation started (the whole span,
  not a recent window: with long-tailed lengths a window's rate swings with whichever slow
  samples happened to finish in it);
- each running shard's own: its rows left at its own rate since its attempt started. A shard has
  its own cap on requests in flight (generation.max_inflight), so a shard with more left than
  the others finishes last whatever the run's total rate says.

Its error on a long-tailed run is in bench/RESULTS.md ("ETA on a long-tailed run"). The driver's
progress line (driver/run_progress.py) feeds it the board's counts; `genrun status`
(outputs/status.py) the commit records. Light to import (the standard library only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MIN_SPAN_SECONDS = 2.0
"""A rate needs at least this much time behind it."""


@dataclass(frozen=True)
class ShardPace:
    """One running shard: what it has left and how fast it went."""

    remaining: int
    done: int
    """Trajectories it finished within `seconds` (this attempt)."""
    seconds: float


def rate(done: int, seconds: float) -> float | None:
    return done / seconds if seconds >= MIN_SPAN_SECONDS and done > 0 else None


def estimate_eta(remaining: int, run_done: int, run_seconds: float, shards: Iterable[ShardPace] = ()) -> float | None:
    """Seconds until the run is done: `remaining` trajectories in all, `run_done` finished in
    `run_seconds` of generation; `shards`: the running shards. None: no rate measured yet."""
    if remaining <= 0:
        return 0.0
    run_rate = rate(run_done, run_seconds)
    if run_rate is None:
        return None
    eta = remaining / run_rate
    for shard in shards:
        shard_rate = rate(shard.done, shard.seconds)
        if shard_rate is not None and shard.remaining > 0:
            eta = max(eta, shard.remaining / shard_rate)
    return eta


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
