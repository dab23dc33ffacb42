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


def build_folder(path: Path, shards: int, rows_per_shard: int = 4) -> None:
    folder = StorageFolder(str(path))
    names = [shard_name(i) for i in range(shards)]
    folder.put_json(
        "run.json",
        {
            "fingerprint": "f" * 64,
            "rollout_n": 1,
            "pad_token_id": 0,
            "shards": [
                {"name": name, "range": [i * rows_per_shard, (i + 1) * rows_per_shard]} for i, name in enumerate(names)
            ],
            "config": {"actor_rollout_ref": {"rollout": {"prompt_length": 4, "response_length": 4}}, "generation": {}},
        },
    )
    for i, name in enumerate(names):
        keys = [f"{i * rows_per_shard + row}:0" for row in range(rows_per_shard)]
        part = PartEntry(name="part-00000.parquet", count=rows_per_shard, bytes=1, sha256="0" * 64)
        ShardCheckpoint.start_attempt(folder, name).commit_part(folder, name, part, keys)
        write_marker(
            folder,
            SuccessMarker(
                shard=name,
                shard_id=i,
                range=[i * rows_per_shard, (i + 1) * rows_per_shard],
                num_trajectories=rows_per_shard,
                expected_trajectories=rows_per_shard,
                parts=[part],
            ),
        )


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
            done = subprocess.run(
                [sys.executable, "-m", "flows.cli", "status", str(run)],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=True,
            )
            times.append(time.perf_counter() - started)
        print(done.stdout.splitlines()[-2])
        print("rounds: " + ", ".join(f"{t:.2f} s" for t in times) + f"; median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
