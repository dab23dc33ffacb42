"""Merge memory: peak memory of merging 20,000 trajectories, next to the size of what it writes.

    .venv/bin/python bench/merge_memory.py [--trajectories 20000] [--prompt-length 256]
        [--response-length 1024] [--chunk-size N] [--smoke]

A finished run folder is built in one process as shards commit it (parts of 16 with checksums, one
commit record each; chat-like lengths with a long tail, float32 logprobs, a reward each), then
merged in a fresh one: the peak is its VmHWM (reset just before) less its RSS before `merge_run`,
over the bytes of the trajectories.pkl it wrote (with --chunk-size: of all chunks, and of the
largest, since a chunked merge holds one at a time). `--smoke`: 64 short trajectories merged whole
and in chunks, in this process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import CHUNK_INDEX_FILE, MERGED_FILE, PartEntry
from generation_core.store.trajectory_record import TrajectoryRecord, records_to_parquet

TARGET = 2.0
PARTS_OF = 16
SHARDS = 4


def build_folder(directory: str, trajectories: int, prompt_length: int, response_length: int) -> None:
    """A finished run folder of `trajectories` synthetic trajectories, committed as shards commit
    them: parts of PARTS_OF with their checksums, one commit record per part."""
    rng = np.random.default_rng(0)
    folder = StorageFolder(directory)
    per_shard = -(-trajectories // SHARDS)
    for shard in range(SHARDS):
        shard_dir = Path(directory) / "shards" / f"shard-{shard:05d}"
        shard_dir.mkdir(parents=True)
        indices = range(shard * per_shard, min((shard + 1) * per_shard, trajectories))
        checkpoint = ShardCheckpoint()
        for number, first in enumerate(range(indices.start, indices.stop, PARTS_OF)):
            records = [
                _record(rng, i, prompt_length, response_length)
                for i in range(first, min(first + PARTS_OF, indices.stop))
            ]
            data = records_to_parquet(records)
            name = f"batch-{number:05d}-bench.parquet"
            (shard_dir / name).write_bytes(data)
            part = PartEntry(name=name, count=len(records), bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
            checkpoint.commit_part(folder, shard_dir.name, part, [f"{r.index}:{r.rollout_n}" for r in records])


def _record(rng, index: int, prompt_length: int, response_length: int) -> TrajectoryRecord:
    prompt_tokens = int(np.clip(rng.lognormal(np.log(120), 0.5), 8, prompt_length))
    response_tokens = int(np.clip(rng.lognormal(np.log(400), 0.8), 1, response_length))
    messages = [{"role": "user", "content": f"Question {index}: " + "lorem ipsum " * int(rng.integers(5, 40))}]
    return TrajectoryRecord(
        index=index,
        rollout_n=0,
        prompt_ids=rng.integers(0, 49152, prompt_tokens).tolist(),
        response_ids=rng.integers(0, 49152, response_tokens).tolist(),
        response_mask=[1] * response_tokens,
        response_logprobs=(-np.abs(rng.normal(0, 1.5, response_tokens))).astype(np.float32).tolist(),
        reward_score=float(rng.integers(0, 2)),
        num_turns=2,
        input_fields={
            "agent_name": "single_turn_agent",
            "data_source": "bench",
            "extra_info": {"index": index, "split": "train"},
            "index": index,
            "interaction_kwargs": {},
            "raw_prompt": messages,
            "reward_model": {"ground_truth": str(index % 97), "style": "rule"},
            "tools_kwargs": {},
        },
        extra_fields={
            "raw_prompt": messages,
            "turn_scores": [],
            "tool_rewards": [],
            "min_global_steps": None,
            "max_global_steps": None,
            "reward_extra_info": {"acc": float(index % 2)},
        },
        metrics={
            "generate_sequences": float(rng.uniform(0.5, 20)),
            "tool_calls": 0.0,
            "compute_score": float(rng.uniform(0, 0.01)),
            "num_preempted": -1,
        },
    )


def measure_merge(directory: str, prompt_length: int, response_length: int, chunk_size: int | None) -> dict:
    """Run the merge in this (fresh) process and return its peak memory and output sizes."""
    import generation_core.outputs.merge as merge  # torch and verl: only in the merge's process

    folder = StorageFolder(directory)
    lengths = dict(prompt_length=prompt_length, response_length=response_length, pad_token_id=2)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    started = time.perf_counter()
    if chunk_size is None:
        rows, files = len(merge.merge_run(folder, **lengths)), [MERGED_FILE]
    else:
        rows = merge.merge_run_chunked(folder, chunk_size=chunk_size, **lengths).rows
        files = [chunk["name"] for chunk in folder.read_json(CHUNK_INDEX_FILE)["chunks"]]
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    sizes = [os.path.getsize(os.path.join(directory, name)) for name in files]
    return {
        "rows": rows,
        "seconds": seconds,
        "peak_bytes": (peak - before) * 1024,
        "largest_file": max(sizes),
        "total_bytes": sum(sizes),
        "files": len(files),
    }


def _status_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {name} in /proc/self/status")


def _run_step(*step: str) -> dict:
    """One step in a fresh process: its peak memory is the merge's alone."""
    result = subprocess.run([sys.executable, __file__, *step], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{step[0]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def smoke() -> None:
    with tempfile.TemporaryDirectory(prefix="genrun-merge-smoke-") as scratch:
        build_folder(scratch, 64, 32, 64)
        for chunk_size in (None, 16):
            result = measure_merge(scratch, 32, 64, chunk_size)
            assert result["rows"] == 64, result
            print(f"smoke: merged 64 trajectories into {result['files']} file(s), chunk_size {chunk_size}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=20000)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="seconds: a small folder merged in this process")
    parser.add_argument("--step-merge", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = (args.prompt_length, args.response_length)
    if args.smoke:
        return smoke()
    if args.step_merge:
        return print(json.dumps(measure_merge(args.step_merge, *lengths, args.chunk_size)))
    with tempfile.TemporaryDirectory(prefix="genrun-merge-bench-") as scratch:
        build_folder(scratch, args.trajectories, *lengths)
        chunk = [] if args.chunk_size is None else ["--chunk-size", str(args.chunk_size)]
        sizes = ["--prompt-length", str(lengths[0]), "--response-length", str(lengths[1])]
        r = _run_step("--step-merge", scratch, *sizes, *chunk)
    mib = 1 / (1 << 20)
    what = "largest chunk" if args.chunk_size else "trajectories.pkl"
    print(f"{args.trajectories} trajectories, prompt_length {lengths[0]}, response_length {lengths[1]}")
    print(
        f"{what} {r['largest_file'] * mib:.1f} MiB ({r['files']} file(s), {r['total_bytes'] * mib:.1f} MiB in all), "
        f"merge peak {r['peak_bytes'] * mib:.1f} MiB, {r['seconds']:.1f} s"
    )
    if args.chunk_size:
        print(f"merge peak / largest chunk = {r['peak_bytes'] / r['largest_file']:.2f}")
    whole = "all chunks" if args.chunk_size else what
    print(f"merge peak / {whole} = {r['peak_bytes'] / r['total_bytes']:.2f} (target <= {TARGET:.1f})")


if __name__ == "__main__":
    main()
