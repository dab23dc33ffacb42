"""`genrun status` on a finished 1,000-shard run folder (issue 32, item 2: under 1.5 s, no torch,
verl or Ray).

    .venv/bin/python bench/status_many_shards.py [--shards 1000] [--rounds 3] [--smoke]

The folder is built without a run (run.json; per shard a commit record, its `done` record and
`_SUCCESS.json`); each round is a fresh `python -m flows.cli status DIR` process, imports included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from generation_core.store.commit_log import ShardCheckpoint, write_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import PartEntry, SuccessMarker, shard_name

REPO = Path(__file__).resolve().parent.parent


def build_folder(path: Path, shards: int, rows: int = 4) -> None:
    folder = StorageFolder(str(path))
    ranges = {shard_name(i): [i * rows, (i + 1) * rows] for i in range(shards)}
    lengths = {"prompt_length": 4, "response_length": 4}
    plan = {"fingerprint": "f" * 64, "rollout_n": 1, "pad_token_id": 0}
    plan["shards"] = [{"name": name, "range": shard_range} for name, shard_range in ranges.items()]
    folder.put_json("run.json", plan | {"config": {"actor_rollout_ref": {"rollout": lengths}, "generation": {}}})
    for i, (name, (start, end)) in enumerate(ranges.items()):
        part = PartEntry(name="part-00000.parquet", count=rows, bytes=1, sha256="0" * 64)
        ShardCheckpoint.start_attempt(folder, name).commit_part(
            folder, name, part, [f"{n}:0" for n in range(start, end)]
        )
        marker = SuccessMarker(name, i, [start, end], num_trajectories=rows, expected_trajectories=rows, parts=[part])
        write_marker(folder, marker)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds: 20 shards, one round")
    args = parser.parse_args()
    if args.smoke:
        args.shards, args.rounds = 20, 1
    with tempfile.TemporaryDirectory() as scratch:
        run = Path(scratch) / "run"
        started = time.perf_counter()
        build_folder(run, args.shards)
        print(f"built {args.shards} finished shards in {time.perf_counter() - started:.1f} s")
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            command = [sys.executable, "-m", "flows.cli", "status", str(run)]
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
            times.append(time.perf_counter() - started)
        print(done.stdout.splitlines()[-2])
        print("rounds: " + ", ".join(f"{t:.2f} s" for t in times) + f"; median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
