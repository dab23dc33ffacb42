"""How close any ETA can get on a long-tailed run: genrun's estimate beside an oracle's (issue 35, item 3).

    .venv/bin/python bench/eta_floor.py [--seeds 30] [--sigma 1.0] [--median 0.2]

bench/eta.py measures the progress line's ETA on one real run; its max error from 10% done moved
between 5.5% and 11.7% from sitting to sitting. This bench asks how much of that any estimator
could remove. It simulates the completions of a pool of `slots` requests in flight, each request
taking a log-normal time (median --median s, sigma --sigma; seeded), every request started the
moment a slot frees, and judges at every 0.5 s tick from 10% done (as bench/eta.py and the run's
ledger do: |ETA - the time really left| / the whole duration):
- `genrun`: shard/eta.estimate_eta as the progress line computes it: the counts, the histogram of
  how long the finished requests took and how many are open (what the shards report), so that
  it adds the drain of the open ones at the end;
- `counts only`: the same on the counts alone, as `genrun status` computes it from the commits
  (and the progress line did before it had durations);
- `oracle`: an estimator that knows the true mean time per request and the expected drain at
  the end (the mean of the largest of `slots` residual times): remaining x mean / slots + drain.
  No estimator from counts can know more; what is left of its error is the luck of the draw (which
  long requests start last, how fast the first tenth went).
Printed per size: the median of each seed's max error, and in how many seeds it exceeds 10%.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from generation_core.shard.eta import JUDGED_FROM, Durations, ShardPace, estimate_eta  # noqa: E402 - after the path

TICK = 0.5
TARGET = 0.10
SIZES = ((2400, 16), (24000, 16), (24000, 128), (240000, 256))
"""(trajectories, requests in flight): bench/eta.py's run, 10x longer, 8x wider, a GPU-sized pool."""


def finish_times(seed: int, count: int, slots: int, median: float, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """When each request finishes and how long it took, in the order they finish: `slots` at a
    time, the next starting as one ends."""
    rng = np.random.default_rng(seed)
    times = median * np.exp(sigma * rng.standard_normal(count))
    running = [(float(t), i) for i, t in enumerate(times[:slots])]
    heapq.heapify(running)
    ends, took = [], []
    started = slots
    while running:
        end, index = heapq.heappop(running)
        ends.append(end)
        took.append(float(times[index]))
        if started < count:
            heapq.heappush(running, (end + float(times[started]), started))
            started += 1
    return np.array(ends), np.array(took)


def expected_drain(slots: int, median: float, sigma: float) -> float:
    """E[the largest of `slots` residual times] - the mean time: what the end adds to a count-based ETA.
    A request in flight at a random moment has the residual time of density S(x) / mean."""
    mean = median * math.exp(sigma**2 / 2)
    xs = np.linspace(0.0, median * math.exp(7 * sigma), 200001)
    survival = np.array([0.5 * math.erfc(math.log(max(x, 1e-300) / median) / (sigma * math.sqrt(2))) for x in xs])
    step = xs[1] - xs[0]
    residual_cdf = np.minimum(np.cumsum(survival) * step / mean, 1.0)
    return float(np.sum(1.0 - residual_cdf**slots) * step) - mean


def max_errors(ends: np.ndarray, took: np.ndarray, slots: int, mean: float, drain: float) -> tuple[float, float, float]:
    """(genrun's, genrun's on counts alone, the oracle's) largest error over the ticks from 10%
    done to the end. genrun's sees what the shards report: the counts, how long the finished
    requests took, how many are open."""
    count, duration = len(ends), float(ends[-1])
    worst = [0.0, 0.0, 0.0]
    durations, seen = Durations(), 0
    for tick in np.arange(TICK, duration, TICK):
        done = int(np.searchsorted(ends, tick, side="right"))
        for seconds in took[seen:done]:
            durations.add(float(seconds))
        seen = done
        if done < JUDGED_FROM * count or done >= count:
            continue
        left = duration - tick
        pace = ShardPace(remaining=count - done, done=done, seconds=float(tick), open_now=min(slots, count - done))
        etas = (
            estimate_eta(count - done, done, float(tick), [pace], durations),
            estimate_eta(count - done, done, float(tick)),
            (count - done) * mean / slots + drain,
        )
        worst = [
            max(so_far, math.inf if eta is None else abs(eta - left) / duration)
            for so_far, eta in zip(worst, etas, strict=True)
        ]
    genrun, counts_only, oracle = worst
    return genrun, counts_only, oracle


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--median", type=float, default=0.2)
    parser.add_argument("--sigma", type=float, default=1.0)
    args = parser.parse_args()
    mean = args.median * math.exp(args.sigma**2 / 2)
    print(
        f"log-normal request times: median {args.median} s, sigma {args.sigma}; {args.seeds} seeds per size; "
        f"error = |ETA - time left| / duration, judged from {JUDGED_FROM:.0%} done"
    )
    for count, slots in SIZES:
        drain = expected_drain(slots, args.median, args.sigma)
        rows = [
            max_errors(*finish_times(seed, count, slots, args.median, args.sigma), slots, mean, drain)
            for seed in range(args.seeds)
        ]
        duration = count * mean / slots
        # One standard deviation of a count-based ETA at 10% done: the mean time per request
        # estimated from the first tenth's requests (a renewal count's variance), over the 90% left.
        noise = math.sqrt((math.exp(args.sigma**2) - 1) / (JUDGED_FROM * count)) * (1 - JUDGED_FROM)
        print(
            f"{count:>7,} trajectories, {slots:>3} in flight (~{duration:.0f} s; drain +{drain:.1f} s = {drain / duration:.1%}; "
            f"count noise at 10% done {noise:.1%}): median max error, runs over {TARGET:.0%}:"
        )
        for name, column in (("genrun", 0), ("counts only (status)", 1), ("oracle", 2)):
            errors = np.array([row[column] for row in rows])
            print(f"    {name:24s} {np.median(errors):6.1%}  {int((errors > TARGET).sum()):>2}/{args.seeds}")


if __name__ == "__main__":
    main()
