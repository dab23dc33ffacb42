"""A run's ETA from its committed rate and the rows each shard has left.

Two bounds, the later one wins:
- the run's: every trajectory left, at the run's rate since generation started (the whole span,
  not a recent window: with long-tailed lengths a window's rate swings with whichever slow
  samples happened to finish in it);
- each running shard's own: its rows left at its own rate since its attempt started. A shard has
  its own cap on requests in flight (generation.max_inflight), so a shard with more left than
  the others finishes last whatever the run's total rate says.

A rate says when the last trajectory *starts*, not when it ends: the run ends when the longest of
the trajectories then open ends. Where the shards report how long their finished trajectories
took (`Durations`, a log-spaced histogram) and how many are open, each bound is the time to start
what has not started (its trajectories left less those open, at the rate) plus the expected
longest residual time of as many open trajectories (`Durations.expected_longest`). On a run with
many trajectories in flight against its length this drain is most of a count-based ETA's error
(bench/eta_floor.py: 24,000 trajectories, 128 in flight, median max error 7.5% -> 5.4%). Without
durations (`genrun status`, which reads commits only) the bound is the rate's alone.

Light to import (the standard library only): `genrun status` uses it, and `format_seconds`.

The driver's progress line (RunProgress.totals) feeds it the board's counts; `genrun status`
feeds it the commit records (outputs/pace.py). bench/eta.py measures it on a long-tailed run.

`EtaTrace` keeps what the progress line predicted, thinned to a few hundred points, so that a
finished run can say how far off it was (`trace_summary`: manifest.json's ledger, the report's
"ETA: predicted vs actual" plot); `cost_to_go` turns an ETA into the cost of the rest of the run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_SPAN_SECONDS = 2.0
"""A rate needs at least this much time behind it."""
TRACE_POINTS = 240
"""An ETA trace keeps at most this many points (a day-long run thins to one every few minutes)."""
JUDGED_FROM = 0.1
"""An ETA is judged once this share of the run is done (before, it rests on too little)."""


DURATION_BIN_BASE = 0.01
"""Seconds at the lower edge of a Durations histogram's bin 0."""
DURATION_BIN_RATIO = 1.25
"""Each bin is 1.25x as wide as the one before: 90 bins reach a week, each within 12% of its middle."""
DURATION_BINS = 90


@dataclass
class Durations:
    """How long finished trajectories took, from start to end: a sparse histogram of log-spaced
    bins (bin -> count), small enough to ride on every progress report."""

    counts: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def bin_of(seconds: float) -> int:
        if seconds <= DURATION_BIN_BASE:
            return 0
        return min(int(math.log(seconds / DURATION_BIN_BASE, DURATION_BIN_RATIO)), DURATION_BINS - 1)

    @staticmethod
    def middle(bin_index: int) -> float:
        """A bin's geometric middle (bin 0: half its upper edge)."""
        low = DURATION_BIN_BASE * DURATION_BIN_RATIO**bin_index
        return low * math.sqrt(DURATION_BIN_RATIO) if bin_index else low / 2

    def add(self, seconds: float) -> None:
        key = self.bin_of(seconds)
        self.counts[key] = self.counts.get(key, 0) + 1

    def merge(self, counts: Mapping[Any, int]) -> None:
        """Add another histogram's counts (keys may be strings: a report that went through JSON)."""
        for key, count in counts.items():
            self.counts[int(key)] = self.counts.get(int(key), 0) + int(count)

    def expected_longest(self, open_now: int) -> float:
        """The expected longest of the residual times of `open_now` trajectories in flight. An
        open trajectory seen at a random moment is more likely a long one: its time left has the
        density S(x) / mean (S: the share of trajectories that take longer than x), whatever the
        distribution; the longest of n such has E = integral of 1 - F(x)^n. 0.0 without data."""
        total = sum(self.counts.values())
        if open_now <= 0 or total == 0:
            return 0.0
        points = sorted((self.middle(key), count) for key, count in self.counts.items())
        mean = sum(x * count for x, count in points) / total
        expected, start, longer, residual_cdf = 0.0, 0.0, total, 0.0
        for x, count in points:
            # S is `longer / total` from `start` to `x`; the residual CDF grows linearly there.
            width, survival = x - start, longer / total
            grown = residual_cdf + survival * width / mean
            # integral of 1 - F^n over the segment, F linear from residual_cdf to grown (exact).
            if grown > residual_cdf:
                expected += width * (
                    1.0
                    - (grown ** (open_now + 1) - residual_cdf ** (open_now + 1))
                    / ((open_now + 1) * (grown - residual_cdf))
                )
            else:
                expected += width * (1.0 - residual_cdf**open_now)
            start, longer, residual_cdf = x, longer - count, grown
        return expected


@dataclass(frozen=True)
class ShardPace:
    """One running shard: what it has left and how fast it went."""

    remaining: int
    done: int
    """Trajectories it finished within `seconds` (this attempt)."""
    seconds: float
    open_now: int = 0
    """Its trajectories in flight now (0: not reported)."""


def rate(done: int, seconds: float) -> float | None:
    return done / seconds if seconds >= MIN_SPAN_SECONDS and done > 0 else None


def _bound(remaining: int, pace: float, open_now: int, durations: Durations | None) -> float:
    """When the last of `remaining` ends: the ones not started yet start at `pace` as others end,
    then the longest open one drains (module doc)."""
    open_now = min(open_now, remaining)
    if durations is None or open_now <= 0 or not durations.counts:
        return remaining / pace
    return (remaining - open_now) / pace + durations.expected_longest(open_now)


def estimate_eta(
    remaining: int,
    run_done: int,
    run_seconds: float,
    shards: Iterable[ShardPace] = (),
    durations: Durations | None = None,
) -> float | None:
    """Seconds until the run is done: `remaining` trajectories in all, `run_done` finished in
    `run_seconds` of generation; `shards`: the running shards; `durations`: how long finished
    trajectories took (with it, the drain of those open is added). None: no rate measured yet."""
    if remaining <= 0:
        return 0.0
    run_rate = rate(run_done, run_seconds)
    if run_rate is None:
        return None
    shards = list(shards)
    eta = _bound(remaining, run_rate, sum(shard.open_now for shard in shards), durations)
    for shard in shards:
        shard_rate = rate(shard.done, shard.seconds)
        if shard_rate is not None and shard.remaining > 0:
            eta = max(eta, _bound(shard.remaining, shard_rate, shard.open_now, durations))
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
