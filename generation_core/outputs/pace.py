"""`genrun status DIR` on a running run: its ETA, and "stalled since ..." with the shards
concerned, from the run folder alone (no board, no Ray: light to import, like status.py).

Commit records say when (`time`) and for which run (`lease`) they were written; a shard's
`attempt` record is the running run's claim on it, its `part` records what it committed since.
Of each shard the run holding the folder's lease has started: when its attempt began, what it
committed since, and its newest record. The ETA is shard/eta.py's over those commits (the
driver's progress line uses the same estimate over the board's finer counts), and with
`generation.gpu_hour_price` what the rest costs (shard/eta.cost_to_go) on the devices the running
invocation holds, as its lease says. A started shard
none of whose records is younger than `generation.stall_seconds` is stalled: a working shard
commits at least every `part_max_seconds` once anything finished (60 s by default, under the
least default stall_seconds, 120 s). The running genrun's own alarm (driver/stall_alarm.py) also
sees generated tokens; the folder shows commits only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from generation_core.config.settings import GenerationSettings
from generation_core.shard.eta import ShardPace, cost_to_go, estimate_eta, format_seconds
from generation_core.store.commit_log import read_commit_records
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseRecord, newest_lease
from generation_core.store.run_record import RunRecord


@dataclass(frozen=True)
class StartedShard:
    """A shard as the run holding the folder left it in its commit records."""

    name: str
    finished: bool
    started: float
    """When the running run's first attempt at it began (unix time)."""
    newest: float
    """Its newest record of the running run."""
    committed: int
    """Trajectories it committed under the running run."""
    remaining: int


def started_shards(folder: StorageFolder, states: list[dict[str, Any]], lease: int) -> list[StartedShard]:
    """The shards the run of lease generation `lease` has started, from their commit records."""
    started = []
    for state in states:
        _, records = read_commit_records(folder, state["shard"])
        own = [record for record in records if record.get("lease") == lease]
        attempts = [float(record.get("time") or 0.0) for record in own if record.get("kind") == "attempt"]
        if not attempts:
            continue  # waiting for a worker, or finished by an earlier run
        committed = sum(
            int((record.get("part") or {}).get("count") or 0) for record in own if record.get("kind") == "part"
        )
        finished = state["state"] == "done"
        remaining = 0 if finished else max(state["expected"] - state["committed"] - state["failed_samples"], 0)
        started.append(
            StartedShard(
                state["shard"],
                finished,
                min(attempts),
                max(float(r.get("time") or 0.0) for r in own),
                committed,
                remaining,
            )
        )
    return started


def devices_and_price(holder: LeaseRecord, config: dict[str, Any]) -> tuple[int, float | None]:
    """The devices the running invocation generates on and its GPU-hour price, as its lease
    says (ReplicaLayout.devices_held). A lease written by an older genrun lacks them: then run.json's
    trainer.n_gpus_per_node x nnodes and its price (this module must not import omegaconf,
    which the layout needs)."""
    if holder.devices is not None:
        return holder.devices, holder.gpu_hour_price
    trainer = config.get("trainer") or {}
    devices = max(int(trainer.get("n_gpus_per_node") or 1) * int(trainer.get("nnodes") or 1), 1)
    return devices, (config.get("generation") or {}).get("gpu_hour_price")


def pace_lines(
    folder: StorageFolder, run: RunRecord, states: list[dict[str, Any]], now: float | None = None
) -> list[str]:
    """The ETA line and, when stalled, the stall line; none when no running genrun holds the folder."""
    now = time.time() if now is None else now
    holder = newest_lease(folder)
    if holder is None or holder.state(now) is not None:
        return []
    shards = started_shards(folder, states, holder.generation)
    remaining = sum(
        max(s["expected"] - s["committed"] - s["failed_samples"], 0) for s in states if s["state"] != "done"
    )
    lines = []
    if shards:
        running = [s for s in shards if not s.finished]
        eta = estimate_eta(
            remaining,
            sum(s.committed for s in shards),
            now - min(s.started for s in shards),
            [ShardPace(remaining=s.remaining, done=s.committed, seconds=now - s.started) for s in running],
        )
        line = f"ETA {format_seconds(eta)} for {remaining:,} trajectories left (from the commits of this run)"
        devices, price = devices_and_price(holder, run.config)
        cost = cost_to_go(eta, devices, price)
        lines.append(line + (f"; ~{cost:.3g} to go at {price:g}/GPU-hour" if cost is not None else ""))
    stall_seconds = GenerationSettings.of(run.config).stall_seconds
    quiet = [s for s in shards if not s.finished and stall_seconds and now - s.newest >= float(stall_seconds)]
    if quiet:
        since = max(s.newest for s in quiet)
        lines.append(
            f"stalled since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(since))} ({format_seconds(now - since)} "
            f"without a commit): {', '.join(sorted(s.name for s in quiet))}"
        )
    return lines
