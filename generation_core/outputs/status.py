"""Read a run folder without running anything: per-shard status (`genrun status`, and the
report's shard table). Light to import, like every module the read-only commands load: no
torch, verl or Ray (the on-demand merge, which builds a DataProto, is finish.merge_folder)."""

from __future__ import annotations

import json
from typing import Any

from generation_core.build import describe_build, other_build_warning, same_build
from generation_core.outputs.ledger import ledger_lines
from generation_core.outputs.pace import pace_lines
from generation_core.store.commit_log import ShardCheckpoint, read_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import describe_holder
from generation_core.store.run_folder import (
    FAILURES_DIR,
    MANIFEST_FILE,
    merged_files,
    read_last_error,
    read_run_record,
    shard_file,
)
from generation_core.store.run_record import RunRecord


def shard_states(folder: StorageFolder, run: RunRecord) -> list[dict[str, Any]]:
    states = []
    for shard in run.shards:
        name = shard.name
        expected = shard.rows * run.samples_per_prompt
        checkpoint = ShardCheckpoint.load(folder, name)
        marker = read_marker(folder, name, checkpoint)
        if marker is not None:
            done, failed, state, builds = marker.num_trajectories, marker.failures, "done", []
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
                "error": error,
                "builds": builds,
            }
        )
    return states


def print_status(url: str, storage_options: dict[str, Any] | None = None) -> int:
    folder = StorageFolder(url, storage_options)
    run = read_run_record(folder)
    states = shard_states(folder, run)
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
        for line in pace_lines(folder, run, states):
            print(line)
    for s in states:
        detail = (
            f"  {s['failed_samples']} failed sample(s), see {shard_file(s['shard'], FAILURES_DIR)}/"
            if s["failed_samples"]
            else ""
        )
        detail += f"  last error: {s['error']}" if s["error"] else ""
        print(f"  {s['shard']}  {s['state']:<8} {s['committed']}/{s['expected']}{detail}")
    counts = {k: sum(1 for s in states if s["state"] == k) for k in ("done", "partial", "failed", "pending")}
    total = sum(s["committed"] for s in states)
    expected = sum(s["expected"] for s in states)
    failed_samples = sum(s["failed_samples"] for s in states)
    print(
        f"shards: {counts['done']} done, {counts['partial']} running or interrupted, {counts['failed']} failed, "
        f"{counts['pending']} pending; trajectories {total}/{expected}; failed samples {failed_samples}"
    )
    output = merged_files(folder)
    print(f"merged: {'yes (' + output[0] + ')' if output else 'no'}")
    ledger = _finished_ledger(folder)
    if ledger:
        print("\n".join(ledger_lines(ledger)))
    return 0


def _finished_ledger(folder: StorageFolder) -> dict[str, Any] | None:
    """The capacity ledger the run's last finish wrote into manifest.json (None before one)."""
    if not folder.exists(MANIFEST_FILE):
        return None
    try:
        return json.loads(folder.read_bytes(MANIFEST_FILE)).get("ledger")
    except ValueError:
        return None


def _distinct(builds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for position, b in enumerate(builds) if not any(same_build(b, earlier) for earlier in builds[:position])]
