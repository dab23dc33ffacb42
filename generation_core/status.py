"""Read a run folder without running anything: per-shard status, and merge on demand."""

from __future__ import annotations

from generation_core.errors import GenrunError
from generation_core.run import RUN_FILE, merge_repairing
from generation_core.shard import CHECKPOINT, FAILURES, LAST_ERROR, SUCCESS
from generation_core.storage import RunFolder


def _open(url: str) -> tuple[RunFolder, dict]:
    folder = RunFolder(url)
    if not folder.exists(RUN_FILE):
        raise GenrunError(f"{folder.display()} is not a genrun run folder (no {RUN_FILE})")
    return folder, folder.read_json(RUN_FILE)


def shard_states(folder: RunFolder, run: dict) -> list[dict]:
    states = []
    for shard in run["shards"]:
        expected = (shard["range"][1] - shard["range"][0]) * run["rollout_n"]
        base = f"shards/{shard['name']}"
        if folder.exists(f"{base}/{SUCCESS}"):
            marker = folder.read_json(f"{base}/{SUCCESS}")
            done, failed = marker["num_trajectories"], marker.get("failures", 0)
            state = "done"
        else:
            checkpoint = folder.read_json(f"{base}/{CHECKPOINT}") if folder.exists(f"{base}/{CHECKPOINT}") else {}
            done, failed = len(checkpoint.get("completed", [])), len(checkpoint.get("failed", []))
            state = "partial" if done or failed else "pending"
        error = None
        if state != "done" and folder.exists(f"{base}/{LAST_ERROR}"):
            state, error = "failed", folder.read_json(f"{base}/{LAST_ERROR}")["error"]
        states.append({"shard": shard["name"], "state": state, "committed": done, "failed_samples": failed, "expected": expected, "error": error})
    return states


def print_status(url: str) -> int:
    folder, run = _open(url)
    states = shard_states(folder, run)
    print(f"run {run['fingerprint'][:12]} at {folder.display()}")
    from generation_core.lease import describe_holder

    holder = describe_holder(folder)
    if holder:
        print(f"in use by a running genrun: {holder}")
    for s in states:
        detail = f"  {s['failed_samples']} failed sample(s), see shards/{s['shard']}/{FAILURES}" if s["failed_samples"] else ""
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
    from generation_core.merge import merged_files

    output = merged_files(folder)
    print(f"merged: {'yes (' + output[0] + ')' if output else 'no'}")
    return 0


def merge_folder(url: str) -> None:
    """Rebuild the merged output from the committed parts, chunked when the run's config says so."""
    from generation_core.lease import RunLease

    folder, run = _open(url)
    # Not beside a run that is still writing parts (its own merge would follow anyway).
    with RunLease.acquire(folder, run["config"].get("generation", {}).get("lease_seconds", 60)):
        merge_repairing(folder, lambda: _merge(folder, run))


def _merge(folder, run) -> None:
    from generation_core.merge import MERGED_FILE, merge_run, merge_run_chunked

    rollout = run["config"]["actor_rollout_ref"]["rollout"]
    lengths = dict(prompt_length=rollout["prompt_length"], response_length=rollout["response_length"], pad_token_id=run["pad_token_id"])
    chunk_size = run["config"].get("generation", {}).get("merge_chunk_size")
    if chunk_size:
        output = merge_run_chunked(folder, chunk_size=chunk_size, **lengths)
        print(f"merged {output.rows} trajectories into {folder.display(output.entry_file)}")
        return
    data = merge_run(folder, **lengths)
    print(f"merged {len(data)} trajectories into {folder.display(MERGED_FILE)}")
