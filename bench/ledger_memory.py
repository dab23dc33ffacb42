"""Ledger memory: the driver's peak memory while finish computes the capacity ledger, by trajectories.

    .venv/bin/python bench/ledger_memory.py [--trajectories 1000000] [--smoke]

A finished run folder is built as the instant engine's shards commit it: SHARDS shards streaming
at once onto REPLICAS replicas, one model turn per trajectory (its provenance as the instant
engine writes it), parts of PARTS_OF trajectories holding only the columns the ledger reads
(provenance and the time split), each part's commit record with its counters (PartActivity), a
done record and a marker per shard. The ledger is then computed in a fresh process each way: from
the parts' counters the markers list (finish since issue 53 item 4; the driver holds the markers,
read here from their files without folding the commit records), and by reparsing every trajectory's provenance (finish before:
one tuple per model turn). The peak is the process's VmHWM (reset just before) less its RSS
before. `--smoke`: 2,000 trajectories, both ways in this process, their figures compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from generation_core.outputs.ledger import ReplicaActivity, capacity_ledger, replica_activity
from generation_core.store.commit_log import ShardCheckpoint, write_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import (
    SHARDS_DIR,
    SUCCESS_FILE,
    PartActivity,
    PartEntry,
    SuccessMarker,
    shard_file,
)
from generation_core.store.trajectory_record import TIMINGS

SHARDS = 4
REPLICAS = 2
PARTS_OF = 10_000
TURN_SECONDS = 0.0004
"""An instant-engine request: a fraction of a millisecond."""
PER_SHARD_RATE = 400.0
"""Trajectories a shard starts per second (the instant engine at 1M trajectories, bench/RESULTS.md)."""
COLUMNS = ["provenance", *(f"seconds_{name}" for name in TIMINGS)]


def _trajectory(shard: int, i: int) -> tuple[dict[str, Any], dict[str, float | None]]:
    # Shards a little apart, so that no two turns on one replica touch (a float's rounding at
    # 1.8e9 would make touching turns overlap by a few hundred nanoseconds).
    started = 1_800_000_000.0 + i / PER_SHARD_RATE + shard * 0.0006
    replica = f"replica-{(i + shard) % REPLICAS}"
    provenance = {
        "engine": "instant",
        "engine_version": "0.0",
        "model_digest": "m" * 16,
        "seed": None,
        "sampling_digest": "s" * 16,
        "attempt": 1,
        "retries": 0,
        "started_at": round(started, 6),
        "turns": [{"replica": replica, "stop_reason": "stop", "start": 0.0001, "seconds": TURN_SECONDS, "tokens": 16}],
    }
    return provenance, {"slot_wait": None, "prefill": None, "decode": TURN_SECONDS, "tools": None, "reward": None}


def build_folder(directory: str, trajectories: int) -> None:
    """The folder the module docstring describes."""
    folder = StorageFolder(directory)
    per_shard = -(-trajectories // SHARDS)
    for shard in range(SHARDS):
        name = f"shard-{shard:05d}"
        (Path(directory) / SHARDS_DIR / name).mkdir(parents=True)
        checkpoint = ShardCheckpoint.start_attempt(folder, name)
        count = min(per_shard, trajectories - shard * per_shard)
        for number, first in enumerate(range(0, count, PARTS_OF)):
            rows = [_trajectory(shard, i) for i in range(first, min(first + PARTS_OF, count))]
            counted = PartActivity()
            for provenance, timings in rows:
                counted.add(provenance, timings)
            table = pa.table(
                {
                    "provenance": [json.dumps(p) for p, _ in rows],
                    **{f"seconds_{t}": pa.array([s[t] for _, s in rows], pa.float64()) for t in TIMINGS},
                }
            )
            part = f"batch-{number:05d}-ledger00.parquet"
            pq.write_table(table, str(Path(directory) / shard_file(name, part)))
            data = (Path(directory) / shard_file(name, part)).read_bytes()
            entry = PartEntry(
                part, len(rows), len(data), hashlib.sha256(data).hexdigest(), 0, 16 * len(rows), 0.01, counted.to_dict()
            )
            checkpoint.commit_part(
                folder, name, entry, [f"{shard * per_shard + i}:0" for i in range(first, first + len(rows))]
            )
        marker = SuccessMarker(
            name, shard, [shard * per_shard, shard * per_shard + count], count, count, parts=checkpoint.parts
        )
        write_marker(folder, marker, checkpoint=checkpoint)


def reparsed_activity(folder: StorageFolder) -> ReplicaActivity:
    """The ledger's activity as finish computed it before issue 53 item 4: every committed
    trajectory's provenance parsed in the driver, one (start, end) tuple per model turn."""
    activity = ReplicaActivity()
    for shard in folder.list(SHARDS_DIR):
        for part in ShardCheckpoint.load(folder, shard).parts:
            activity.time_split["storage"] += part.storage_seconds or 0.0
            with folder.open_read(shard_file(shard, part.name)) as handle:
                table = pq.ParquetFile(handle).read(columns=COLUMNS)
            for name in TIMINGS:
                activity.time_split[name] += sum(
                    v for v in table.column(f"seconds_{name}").to_pylist() if v is not None
                )
            for text in table.column("provenance").to_pylist():
                activity.add_trajectory(json.loads(text), since=0.0)
    return activity


def counted_activity(folder: StorageFolder) -> ReplicaActivity:
    """The ledger's activity as finish computes it now: the parts' counters the markers list
    (read from _SUCCESS.json here: the driver holds them as the shard jobs returned them)."""
    markers = [
        SuccessMarker.from_dict(folder.read_json(shard_file(shard, SUCCESS_FILE))) for shard in folder.list(SHARDS_DIR)
    ]
    return replica_activity(part for marker in markers for part in marker.parts)


WAYS = {"reparsed": reparsed_activity, "counted": counted_activity}


def measure(directory: str, way: str) -> dict[str, Any]:
    """The ledger one way, in this (fresh) process: its peak memory, time and figures."""
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    started = time.perf_counter()
    activity = WAYS[way](StorageFolder(directory))
    ledger = capacity_ledger(
        activity, wall_seconds=1.0, replicas=REPLICAS, gpus_per_replica=0, output_tokens=0, gpu_hour_price=None
    )
    seconds = time.perf_counter() - started
    return {"peak_bytes": (_status_kib("VmHWM") - before) * 1024, "seconds": seconds, "ledger": ledger}


def _status_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {name} in /proc/self/status")


def _run_step(directory: str, way: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, __file__, "--step", way, directory], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{way} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _same_counts(reparsed: dict[str, Any], counted: dict[str, Any]) -> bool:
    """Requests, tokens, the window and the time split agree (busy time: see bench/RESULTS.md)."""
    keys = ("requests", "output_tokens")
    rows = [
        {r: {k: row[k] for k in keys} for r, row in ledger["per_replica"].items()} for ledger in (reparsed, counted)
    ]
    return (
        rows[0] == rows[1]
        and reparsed["generation_window_seconds"] == counted["generation_window_seconds"]
        and reparsed["time_split_seconds"] == counted["time_split_seconds"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1_000_000)
    parser.add_argument("--smoke", action="store_true", help="seconds: 2,000 trajectories, both ways in this process")
    parser.add_argument("--step", nargs=2, metavar=("WAY", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        return print(json.dumps(measure(args.step[1], args.step[0])))
    with tempfile.TemporaryDirectory(prefix="genrun-ledger-bench-") as scratch:
        trajectories = 2000 if args.smoke else args.trajectories
        started = time.perf_counter()
        build_folder(scratch, trajectories)
        print(
            f"{trajectories} trajectories in {SHARDS} shards built in {time.perf_counter() - started:.0f} s", flush=True
        )
        step = (lambda way: measure(scratch, way)) if args.smoke else (lambda way: _run_step(scratch, way))
        results = {way: step(way) for way in WAYS}
    for way, result in results.items():
        busy = {r: row["busy_seconds"] for r, row in result["ledger"]["per_replica"].items()}
        print(
            f"{way}: ledger peak {result['peak_bytes'] / (1 << 20):.1f} MiB, {result['seconds']:.1f} s; busy seconds {busy}"
        )
    same = _same_counts(results["reparsed"]["ledger"], results["counted"]["ledger"])
    print(f"requests, tokens, window and time split the same both ways: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
