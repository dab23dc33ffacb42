"""`genrun status` on a finished 1,000-shard run folder (issue 32, item 2: under 1.5 s, no torch,
verl or Ray).

    .venv/bin/python bench/status_many_shards.py [--shards 1000] [--rounds 3] [--smoke]
    .venv/bin/python bench/status_many_shards.py --s3-requests [--shards 1000]

The folder is built without a run (run.json; per shard a commit record, its `done` record and
`_SUCCESS.json`); each round is a fresh `python -m flows.cli status DIR` process, imports included.

`--s3-requests` (issue 53 item 3): the S3 requests (listings, GETs, HEADs) of one `genrun status`
(print_status, in this process) on a folder on a local S3 server (moto) that a running run holds
(its lease is held here: the ETA and stall lines are computed), every shard started under it and
every other one finished; and of finding the part the run's example line shows (`example_part`)
against `committed_parts` (which it called before). Counted at s3fs's one door to botocore.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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


def build_running_folder(folder: StorageFolder, shards: int, fence: Any, rows: int = 4) -> None:
    """build_folder's shards under a held lease, odd shards still running (half their rows committed)."""
    ranges = {shard_name(i): [i * rows, (i + 1) * rows] for i in range(shards)}
    lengths = {"prompt_length": 4, "response_length": 4}
    plan = {"fingerprint": "f" * 64, "rollout_n": 1, "pad_token_id": 0}
    plan["shards"] = [{"name": name, "range": shard_range} for name, shard_range in ranges.items()]
    folder.put_json("run.json", plan | {"config": {"actor_rollout_ref": {"rollout": lengths}, "generation": {}}})

    def one(i: int) -> None:
        name, (start, end) = shard_name(i), ranges[shard_name(i)]
        count = rows if i % 2 == 0 else rows // 2
        part = PartEntry(name="part-00000.parquet", count=count, bytes=1, sha256="0" * 64)
        checkpoint = ShardCheckpoint.start_attempt(folder, name, fence)
        checkpoint.commit_part(folder, name, part, [f"{n}:0" for n in range(start, start + count)], fence=fence)
        if i % 2 == 0:
            marker = SuccessMarker(
                name, i, [start, end], num_trajectories=rows, expected_trajectories=rows, parts=[part]
            )
            write_marker(folder, marker, fence, checkpoint)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(shards)))


def count_s3_requests(shards: int) -> None:
    """`--s3-requests`: see the module's docstring."""
    import s3fs

    sys.path.insert(0, str(REPO))  # tests.conftest: the test suite's moto server
    from flows.run_command import example_part
    from generation_core.outputs.status import print_status
    from generation_core.store.lease import RunLease
    from generation_core.store.part_repair import committed_parts
    from tests.conftest import S3_ENV, kill_group, start_moto

    requests: Counter[str] = Counter()
    call_s3 = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        requests[method if isinstance(method, str) else method.__name__] += 1
        return await call_s3(self, method, *args, **kwargs)

    with tempfile.TemporaryDirectory() as scratch:
        process, endpoint, log = start_moto(Path(scratch) / "moto.log")
        try:
            options = {
                "endpoint_url": endpoint,
                "key": S3_ENV["AWS_ACCESS_KEY_ID"],
                "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            }
            s3fs.S3FileSystem(**options).mkdir("genrun-bench")
            folder = StorageFolder("s3://genrun-bench/run", options)
            with RunLease.acquire(folder, 3600.0) as lease:
                started = time.perf_counter()
                build_running_folder(folder, shards, lease.fence())
                print(f"built {shards} shards ({shards // 2} running) on moto in {time.perf_counter() - started:.1f} s")
                s3fs.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
                try:
                    out = io.StringIO()
                    with contextlib.redirect_stdout(out):
                        print_status(folder.url, options)
                    print(
                        "status: "
                        + " | ".join(
                            line for line in out.getvalue().splitlines() if line.startswith(("ETA", "shards:"))
                        )
                    )
                    print(f"genrun status: {dict(requests)}; {sum(requests.values())} requests")
                    requests.clear()
                    committed_parts(folder)
                    print(
                        f"committed_parts (the example's part, before): {dict(requests)}; {sum(requests.values())} requests"
                    )
                    requests.clear()
                    rows = [{"shard": shard_name(i), "samples": 4} for i in range(shards)]
                    example_part(folder, {"shards": rows})
                    print(f"example_part (after): {dict(requests)}; {sum(requests.values())} requests")
                finally:
                    s3fs.S3FileSystem._call_s3 = call_s3  # type: ignore[method-assign]
        finally:
            kill_group(process)
            log.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds: 20 shards, one round")
    parser.add_argument("--s3-requests", action="store_true", help="count S3 requests of one status (moto)")
    args = parser.parse_args()
    if args.s3_requests:
        count_s3_requests(args.shards)
        return
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
