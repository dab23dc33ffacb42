"""A run's ETA from its committed rate and the rows each shard has left.

Two bounds, the later one wins:
- the run's: every trajectory left, at the run's rate since generation started (the whole span,
  not a recent window: with long-tailed lengths a window's rate swings with whichever slow
  samples happened to finish in it);
- each running shard's own: its rows left at its own rate since its attempt started. A shard has
  its own cap on requests in flight (generation.max_inflight), so a shard with more left than
  the others finishes last whatever the run's total rate says.

Light to import (the standard library only): `genrun status` uses it, and `format_seconds`.

The driver's progress line (RunProgress.totals) feeds it the board's counts; `genrun status`
feeds it the commit records (outputs/pace.py). bench/eta.py measures it on a long-tailed run.

`EtaTrace` keeps what the progress line predicted, thinned to a few hundred points, so that a
finished run can say how far off it was (`trace_summary`: manifest.json's ledger, the report's
"ETA: predicted vs actual" plot); `cost_to_go` turns an ETA into the cost of the rest of the run.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_SPAN_SECONDS = 2.0
"""A rate needs at least this much time behind it."""
TRACE_POINTS = 240
"""An ETA trace keeps at most this many points (a day-long run thins to one every few minutes)."""
JUDGED_FROM = 0.1
"""An ETA is judged once this share of the run is done (before, it rests on too little)."""


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
    `run_seconds` of generation; `shards`: the running shards (None: no rate measured yet)."""
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


def cost_to_go(eta: float | None, devices: int, gpu_hour_price: float | None) -> float | None:
    """What the rest of the run costs: `devices` (GPUs; a CPU replica counts as one) held for
    `eta` seconds at `gpu_hour_price` per device-hour (None: no price set, or no ETA yet)."""
    if eta is None or gpu_hour_price is None:
        return None
    return eta / 3600.0 * max(devices, 1) * gpu_hour_price


@dataclass
class EtaTrace:
    """The ETAs a run's progress line showed: (seconds since generation started, trajectories
    done, trajectories in all, ETA seconds or None), at most TRACE_POINTS of them: when full,
    every other point goes and points are taken half as often."""

    points: list[tuple[float, int, int, float | None]] = field(default_factory=list)
    spacing: float = 1.0
    ended: float | None = None
    """Seconds since generation started when nothing was left (None: not ended, e.g. stopped)."""

    def add(self, seconds: float, done: int, total: int, eta: float | None) -> None:
        if self.ended is None and total > 0 and done >= total:
            self.ended = seconds
        if self.ended is not None or (self.points and seconds - self.points[-1][0] < self.spacing):
            return
        self.points.append((round(seconds, 3), done, total, None if eta is None else round(eta, 3)))
        if len(self.points) > TRACE_POINTS:
            self.points = self.points[::2]
            self.spacing *= 2


def eta_errors(points: Iterable[Sequence[Any]], ended: float) -> list[float]:
    """Each judged point's error: |ETA - the time that was really left| / the generation's
    duration, for the points from JUDGED_FROM of the run done to its end that showed an ETA."""
    errors = []
    for seconds, done, total, eta in points:
        if eta is None or done < JUDGED_FROM * total or done >= total or seconds >= ended or ended <= 0:
            continue
        errors.append(abs(eta - (ended - seconds)) / ended)
    return errors


def trace_summary(trace: EtaTrace) -> dict[str, Any] | None:
    """The trace as manifest.json's ledger keeps it, with its median and largest error; None
    when the run did not end (stopped) or never showed an ETA."""
    if trace.ended is None or not any(point[3] is not None for point in trace.points):
        return None
    errors = eta_errors(trace.points, trace.ended)
    return {
        "generation_seconds": round(trace.ended, 3),
        "judged_from_done": JUDGED_FROM,
        "median_error": round(statistics.median(errors), 4) if errors else None,
        "max_error": round(max(errors), 4) if errors else None,
        "points": [list(point) for point in trace.points],
    }


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
