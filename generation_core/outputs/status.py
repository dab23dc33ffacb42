"""Read a run folder without running anything: per-shard status (`genrun status`, and the
report's shard table). Light to import, like every module the read-only commands load: no
torch, verl or Ray (the on-demand merge, which builds a DataProto, is finish.merge_folder).

On a running run it adds its ETA and "stalled since ..." with the shards concerned, from the
folder alone (no board, no Ray). Commit records say when (`time`) and for which run (`lease`)
they were written; a shard's `attempt` record is the running run's claim on it, its `part`
records what it committed since. The ETA is shard/eta.py's over the commits of the run holding
the folder's lease (the driver's progress line uses the same estimate over the board's finer
counts). A started shard none of whose records is younger than `generation.stall_seconds` is
stalled: a working shard commits at least every `part_max_seconds` once anything finished (60 s
by default, under the least default stall_seconds, 120 s). The running genrun's own alarm
(driver/stall_alarm.py) also sees generated tokens; the folder shows commits only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from generation_core.build import describe_build, other_build_warning, same_build
from generation_core.config.settings import GenerationSettings
from generation_core.outputs.ledger import ledger_lines, read_ledger
from generation_core.shard.eta import ShardPace, estimate_eta, format_seconds
from generation_core.store.commit_log import ShardCheckpoint, read_commit_records, read_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import describe_holder, newest_lease
from generation_core.store.merged_output import damage_as_merged
from generation_core.store.run_folder import (
    FAILURES_DIR,
    merged_files,
    read_last_error,
    read_run_record,
    shard_file,
)
from generation_core.store.run_record import RunRecord


def shard_states(
    folder: StorageFolder, run: RunRecord, records: dict[str, list[dict[str, Any]]] | None = None
) -> list[dict[str, Any]]:
    """Each shard's state, from one listing and one fold of its commit records. `records`, when
    given, receives each shard's records as read (`pace_lines` takes them: read once per command)."""
    states = []
    for shard in run.shards:
        name = shard.name
        expected = shard.rows * run.samples_per_prompt
        sequences, shard_records = read_commit_records(folder, name)
        checkpoint = ShardCheckpoint.fold(sequences, shard_records)
        if records is not None:
            records[name] = shard_records
        marker = read_marker(folder, name, checkpoint)
        not_needed = 0
        if marker is not None:
            done, failed, state, builds = marker.num_trajectories, marker.failures, "done", []
            not_needed = marker.not_owed  # adaptive sampling's decision: owed no more
        else:
            done, failed, builds = len(checkpoint.completed), len(checkpoint.failed), checkpoint.builds
            state = "partial" if done or failed else "pending"
        error = None
        if state != "done":
            last_error = read_last_error(folder, name)
            if last_error is not None:
                state, error = "failed", last_error["error"]
        states.append(
            {
                "shard": name,
                "state": state,
                "committed": done,
                "failed_samples": failed,
                "expected": expected,
                "not_needed": not_needed,
                "error": error,
                "builds": builds,
            }
        )
    return states


def print_status(url: str, storage_options: dict[str, Any] | None = None) -> int:
    folder = StorageFolder(url, storage_options)
    run = read_run_record(folder)
    records: dict[str, list[dict[str, Any]]] = {}
    states = shard_states(folder, run, records)
    print(f"run {str(run.fingerprint)[:12]} at {folder.display()}")
    # Builds of unfinished shards' attempts (a finished shard's are in its commit records: the report reads them).
    later = [b for s in states for b in s["builds"] if not same_build(b, run.build)]
    print(
        f"written by {describe_build(run.build)}"
        + "".join(f"; attempts also by {describe_build(b)}" for b in _distinct(later))
    )
    warning = other_build_warning(folder.display(), run.build)
    if warning:
        print(f"warning: {warning}")
    holder = describe_holder(folder)
    if holder:
        print(f"in use by a running genrun: {holder}")
        for line in pace_lines(folder, run, states, records):
            print(line)
    for s in states:
        detail = (
            f"  {s['failed_samples']} failed sample(s), see {shard_file(s['shard'], FAILURES_DIR)}/"
            if s["failed_samples"]
            else ""
        )
        detail += f"  last error: {s['error']}" if s["error"] else ""
        drawn = f" drawn, {s['not_needed']} not needed" if s["not_needed"] else ""
        print(f"  {s['shard']}  {s['state']:<8} {s['committed']}/{s['expected']}{drawn}{detail}")
    counts = {k: sum(1 for s in states if s["state"] == k) for k in ("done", "partial", "failed", "pending")}
    total = sum(s["committed"] for s in states)
    expected = sum(s["expected"] for s in states)
    failed_samples = sum(s["failed_samples"] for s in states)
    not_needed = sum(s["not_needed"] for s in states)
    drawn = f" drawn, {not_needed} not needed (adaptive sampling)" if not_needed else ""
    print(
        f"shards: {counts['done']} done, {counts['partial']} running or interrupted, {counts['failed']} failed, "
        f"{counts['pending']} pending; trajectories {total}/{expected}{drawn}; failed samples {failed_samples}"
    )
    output = merged_files(folder)
    damage = damage_as_merged(folder) if output else None
    if damage:
        print(f"merged: damaged, {damage}: the run's command (or `genrun merge {folder.display()}`) merges again")
    else:
        print(f"merged: {'yes (' + output[0] + ')' if output else 'no'}")
    ledger = read_ledger(folder)
    if ledger:
        print("\n".join(ledger_lines(ledger, total)))
    return 0


def _distinct(builds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for position, b in enumerate(builds) if not any(same_build(b, earlier) for earlier in builds[:position])]


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


def started_shards(
    states: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]], lease: int
) -> list[StartedShard]:
    """The shards the run of lease generation `lease` has started, from their commit records as
    `shard_states` read them (`records`)."""
    started = []
    for state in states:
        own = [record for record in records.get(state["shard"], []) if record.get("lease") == lease]
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


def pace_lines(
    folder: StorageFolder,
    run: RunRecord,
    states: list[dict[str, Any]],
    records: dict[str, list[dict[str, Any]]],
    now: float | None = None,
) -> list[str]:
    """The ETA line and, when stalled, the stall line; none when no running genrun holds the folder.
    `states` and `records`: `shard_states`'s answer and the commit records it read."""
    now = time.time() if now is None else now
    holder = newest_lease(folder)
    if holder is None or holder.state(now) is not None:
        return []
    shards = started_shards(states, records, holder.generation)
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
        lines.append(f"ETA {format_seconds(eta)} for {remaining:,} trajectories left (from the commits of this run)")
    stall_seconds = GenerationSettings.of(run.config).stall_seconds
    quiet = [s for s in shards if not s.finished and stall_seconds and now - s.newest >= float(stall_seconds)]
    if quiet:
        since = max(s.newest for s in quiet)
        lines.append(
            f"stalled since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(since))} ({format_seconds(now - since)} "
            f"without a commit): {', '.join(sorted(s.name for s in quiet))}"
        )
    return lines
