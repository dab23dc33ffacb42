"""The capacity ledger of a run: what it cost and where its time went.

Added up from the counters each committed part carries in its commit record (`PartActivity`,
counted by the shard as it wrote the part; the success markers hold them), beside the run's
wall time and replica layout: no trajectory is read at finish, so its memory does not grow with
the run's turns.

- wall seconds, replica-seconds (replicas x wall) and GPU-seconds (x GPUs per replica; a replica
  on the CPU counts as one device for the cost);
- per replica (the server that answered each turn): requests, output tokens, tokens/s over the
  generation window and its idle fraction: the share of the window (first request sent to last
  answer of this invocation, while work remained) in which it ran no request. Its busy time is
  the union of its parts' busy spans, at most the sum of each part's own busy seconds: exact
  unless parts running at once each had more than BUSY_SPANS gaps on one replica;
- the prefix-cache hit rate, where the engine reports hits (hf);
- the time split totals of every trajectory (store/trajectory_record.TIMINGS) plus storage (the parts' write time);
- with `generation.gpu_hour_price`, the cost in total and per 1M output tokens.

Trajectories of earlier invocations (a resumed run) count in the time split; the per-replica
figures and the window are this invocation's (`since`: parts whose first trajectory started since).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import MANIFEST_FILE, PartActivity, PartEntry, busy_spans
from generation_core.store.trajectory_record import TIMINGS


@dataclass
class ReplicaActivity:
    """What the trajectories say each replica did: its busy spans (Unix seconds), requests and tokens."""

    intervals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    busy_bound: dict[str, float] = field(default_factory=dict)
    """The sum of each part's own busy seconds per replica (none when counted trajectory by trajectory)."""
    tokens: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    prefix_hits: int = 0
    prefix_reported: int = 0
    time_split: dict[str, float] = field(default_factory=lambda: dict.fromkeys([*TIMINGS, "storage"], 0.0))

    def add(self, counted: PartActivity, since: float, bound: bool = True) -> None:
        """Add one part's (or one trajectory's) counters; the per-replica ones only when its
        first trajectory started at or after `since`. `bound`: `counted.busy_seconds` is known."""
        self.prefix_hits += counted.prefix_hits
        self.prefix_reported += counted.prefix_reported
        for name, seconds in counted.time_split.items():
            self.time_split[name] = self.time_split.get(name, 0.0) + seconds
        if (counted.started_at or 0.0) < since:
            return
        for replica, spans in counted.busy.items():
            self.intervals.setdefault(replica, []).extend(spans)
            self.tokens[replica] = self.tokens.get(replica, 0) + counted.tokens.get(replica, 0)
            self.requests[replica] = self.requests.get(replica, 0) + counted.requests.get(replica, 0)
            if bound:
                self.busy_bound[replica] = self.busy_bound.get(replica, 0.0) + counted.busy_seconds.get(replica, 0.0)

    def add_trajectory(self, provenance: dict[str, Any], since: float) -> None:
        """One trajectory's provenance (its time split is added apart: the report sums the columns)."""
        one = PartActivity()
        one.add(provenance, None)
        self.add(one, since, bound=False)

    def busy_seconds(self, replica: str) -> float:
        union = sum(end - start for start, end in busy_spans(self.intervals[replica]))
        return min(union, self.busy_bound.get(replica, union))

    @property
    def window(self) -> tuple[float, float] | None:
        """(first request sent, last answer) over every replica; None without any."""
        spans = [span for spans in self.intervals.values() for span in spans]
        if not spans:
            return None
        return min(start for start, _ in spans), max(end for _, end in spans)


def replica_activity(parts: Iterable[PartEntry], since: float = 0.0) -> ReplicaActivity:
    """The committed parts' counters, added up (see the module docstring); parts written before
    genrun counted them add only their storage time."""
    activity = ReplicaActivity()
    for part in parts:
        activity.time_split["storage"] += part.storage_seconds or 0.0
        if part.activity is not None:
            activity.add(PartActivity.from_dict(part.activity), since)
    return activity


def capacity_ledger(
    activity: ReplicaActivity,
    *,
    wall_seconds: float,
    replicas: int,
    gpus_per_replica: int,
    output_tokens: int,
    gpu_hour_price: float | None,
) -> dict[str, Any]:
    """The ledger as manifest.json holds it. `output_tokens`: model tokens generated in this
    invocation (the cost's denominator); `replicas` / `gpus_per_replica`: the run's layout."""
    replica_seconds = replicas * wall_seconds
    device_seconds = replica_seconds * max(gpus_per_replica, 1)
    window = activity.window
    window_seconds = (window[1] - window[0]) if window else 0.0
    per_replica = {}
    for replica in sorted(activity.intervals):
        busy = activity.busy_seconds(replica)
        per_replica[replica] = {
            "requests": activity.requests[replica],
            "output_tokens": activity.tokens[replica],
            "tokens_per_second": round(activity.tokens[replica] / window_seconds, 2) if window_seconds else 0.0,
            "busy_seconds": round(busy, 3),
            "idle_fraction": round(max(0.0, 1.0 - busy / window_seconds), 4) if window_seconds else 0.0,
        }
    ledger: dict[str, Any] = {
        "wall_seconds": round(wall_seconds, 3),
        "replicas": replicas,
        "gpus_per_replica": gpus_per_replica,
        "replica_seconds": round(replica_seconds, 3),
        "gpu_seconds": round(replica_seconds * gpus_per_replica, 3),
        "generation_window_seconds": round(window_seconds, 3),
        "per_replica": per_replica,
        "prefix_cache_hit_rate": round(activity.prefix_hits / activity.prefix_reported, 4)
        if activity.prefix_reported
        else None,
        "time_split_seconds": {name: round(seconds, 3) for name, seconds in activity.time_split.items()},
        "output_tokens": output_tokens,
        "gpu_hour_price": gpu_hour_price,
        "cost": None,
        "cost_per_million_output_tokens": None,
    }
    if gpu_hour_price is not None:
        cost = device_seconds / 3600.0 * gpu_hour_price
        # Six significant digits: a short run's cost is a fraction of a cent.
        ledger["cost"] = float(f"{cost:.6g}")
        ledger["cost_per_million_output_tokens"] = float(f"{cost / output_tokens * 1e6:.6g}") if output_tokens else None
    return ledger


def ledger_lines(ledger: dict[str, Any], trajectories: int | None = None) -> list[str]:
    """The ledger in a few terminal lines (the run's summary, `genrun status`). `trajectories`:
    the committed trajectories, whose seconds the time split adds up."""
    split = ledger.get("time_split_seconds") or {}
    total = sum(split.values()) or 1.0
    lines = [
        f"capacity:      {ledger['replicas']} replica(s) x {ledger['wall_seconds']:.1f} s = {ledger['replica_seconds']:.1f} replica-s"
        + (f" ({ledger['gpu_seconds']:.1f} GPU-s)" if ledger.get("gpus_per_replica") else " (on the CPU)"),
        "time split:    "
        + ", ".join(
            f"{name} {seconds:.1f} s ({100 * seconds / total:.0f}%)" for name, seconds in split.items() if seconds
        )
        # Each trajectory's own seconds, added up: with many in flight the sum exceeds the wall time.
        + f" (summed over {_trajectories(trajectories)})",
    ]
    for replica, row in (ledger.get("per_replica") or {}).items():
        lines.append(
            f"  replica {replica}: {row['requests']} requests, {row['tokens_per_second']:.1f} tok/s, idle {100 * row['idle_fraction']:.0f}%"
        )
    if ledger.get("prefix_cache_hit_rate") is not None:
        lines.append(f"prefix cache:  {100 * ledger['prefix_cache_hit_rate']:.0f}% of requests reused cached KV")
    if ledger.get("cost") is not None:
        per_million = ledger.get("cost_per_million_output_tokens")
        lines.append(
            f"cost:          {ledger['cost']:.4g} at {ledger['gpu_hour_price']:g}/GPU-hour"
            + (f", {per_million:.4g} per 1M output tokens" if per_million is not None else "")
        )
    return lines


def _trajectories(count: int | None) -> str:
    return "trajectories" if count is None else f"{count:,} trajectories"


def read_ledger(folder: StorageFolder) -> dict[str, Any] | None:
    """The ledger the run's last finish wrote into manifest.json (None before one, or unreadable)."""
    if not folder.exists(MANIFEST_FILE):
        return None
    try:
        return json.loads(folder.read_bytes(MANIFEST_FILE)).get("ledger")
    except ValueError:
        return None
