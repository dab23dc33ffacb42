"""Peak memory of the driver and of a shard worker at 2,000 vs 20,000 trajectories (issue 6, target 4).

    .venv/bin/python bench/memory.py [--small 2000] [--large 20000]

Two full `genrun` runs with the instant engine (no model work, so the run is all pipeline:
flow, Ray, agent loops, parts, checkpoints, merge, zip), one shard each, side by side in one
process run. The driver's peak is the `genrun` process's VmHWM (polled every 0.1 s, peak
resident set so far); the shard worker's is the peak the shard records in its marker
(`last_attempt.peak_rss_bytes`, getrusage of the Ray worker that ran it). Both runs merge in
chunks of `--chunk` trajectories (generation.merge_chunk_size), the setting for outputs that
should not be held in memory at once; without it the driver holds the final DataProto, which
grows with the run by design (bench/merge_memory.py measures that merge). The growth from the
small to the large run is printed last (target <= 10%).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from genrun_process import GENRUN, REPO, genrun_env

from generation_core.instrumentation import read_timeline

TARGET = 0.10


def vm_hwm_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def run(scratch: Path, trajectories: int, chunk: int) -> dict[str, int]:
    prompts = scratch / f"prompts-{trajectories}.parquet"
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": f"Question number {i}?"}],
            "extra_info": {"index": i},
        }
        for i in range(trajectories)
    ]
    pq.write_table(pa.Table.from_pylist(rows), prompts)
    out = scratch / f"run-{trajectories}"
    timeline = scratch / f"timeline-{trajectories}.txt"
    env = genrun_env(timeline)
    command = [
        GENRUN,
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.show_progress=false",
        "generation.save_batch_size=500",
        "generation.max_inflight=256",
        f"generation.merge_chunk_size={chunk}",
    ]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    driver_peak, peak_at = 0, time.time()
    while process.poll() is None:
        now = vm_hwm_bytes(process.pid) or 0
        if now > driver_peak:
            driver_peak, peak_at = now, time.time()
        time.sleep(0.1)
    stderr = process.stderr.read()
    if process.returncode != 0:
        sys.exit(f"genrun failed ({process.returncode}):\n{stderr[-3000:]}")
    marker = json.loads(next((out / "shards").glob("*/_SUCCESS.json")).read_text())
    # The run phase the driver's peak was reached in: the last timeline event before it.
    events = [(stamp, name) for name, stamps in read_timeline(timeline).items() for stamp in stamps]
    phase = max([event for event in events if event[0] <= peak_at], default=(0.0, "start"))[1]
    return {
        "driver": driver_peak,
        "driver_peak_after": phase,
        "worker": marker["last_attempt"]["peak_rss_bytes"],
        "trajectories": marker["num_trajectories"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=20000)
    parser.add_argument("--chunk", type=int, default=2000)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-memory-"))
    try:
        small = run(scratch, args.small, args.chunk)
        large = run(scratch, args.large, args.chunk)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    mib = 1024 * 1024
    for name, result in (("small", small), ("large", large)):
        print(
            f"{name}: {result['trajectories']} trajectories: driver peak {result['driver'] / mib:.0f} MiB (reached after `{result['driver_peak_after']}`), shard worker peak {result['worker'] / mib:.0f} MiB"
        )
    for role in ("driver", "worker"):
        growth = large[role] / small[role] - 1
        print(
            f"{role} peak RSS growth {args.small} -> {args.large} trajectories: {100 * growth:+.1f}% (target <= {100 * TARGET:.0f}%)"
        )


if __name__ == "__main__":
    main()
