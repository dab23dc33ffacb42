"""Merge memory: peak memory of merging 20,000 trajectories, next to the size of what it writes.

    .venv/bin/python bench/merge_memory.py [--trajectories 20000] [--prompt-length 256]
        [--response-length 1024] [--chunk-size N] [--baseline GIT_REV]

Definitions (the issue's target: peak <= 2x the DataProto):
- size of the final DataProto: bytes of the trajectories.pkl the merge wrote (with --chunk-size:
  of all chunk files; the ratio to the largest chunk is printed too, since a chunked merge
  holds one chunk at a time);
- peak memory of merging: in a fresh process with everything imported, the peak resident set
  size (VmHWM, reset through /proc/self/clear_refs just before) during `merge_run` minus the
  resident set size just before it.

The run folder is built first, in its own process, the way shards commit it: parts of 16
trajectories (generation.save_batch_size=16, the figures' setting) with checksums, one commit
record per part (shards/<shard>/commits/), or one shards/<shard>/checkpoint.json when the
generation_core it imports predates commit records (a --baseline revision).
Lengths are drawn like real chat generations (prompts ~120 tokens, responses ~400 with a long
tail, clipped to the configured lengths), with float32 logprobs and a reward per trajectory.
With --baseline, the same measurement runs on that revision's code (`git archive`) in the same
sitting, and both are printed side by side; the current tree's ratio is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = 2.0
PARTS_OF = 16
SHARDS = 4


def build_folder(directory: str, trajectories: int, prompt_length: int, response_length: int) -> None:
    """A finished run folder of `trajectories` synthetic trajectories, written with the records
    module of whatever generation_core this process imports."""
    import hashlib

    import numpy as np

    from generation_core.store.trajectory_record import TrajectoryRecord, records_to_parquet

    rng = np.random.default_rng(0)
    root = Path(directory)
    per_shard = -(-trajectories // SHARDS)
    for shard in range(SHARDS):
        shard_dir = root / "shards" / f"shard-{shard:05d}"
        shard_dir.mkdir(parents=True)
        indices = range(shard * per_shard, min((shard + 1) * per_shard, trajectories))
        parts, completed = [], []
        checkpoint = _checkpoint_writer(root, shard_dir.name)
        for first in range(indices.start, indices.stop, PARTS_OF):
            records = [
                _record(TrajectoryRecord, rng, i, prompt_length, response_length)
                for i in range(first, min(first + PARTS_OF, indices.stop))
            ]
            data = records_to_parquet(records)
            name = f"batch-{len(parts):05d}-bench.parquet"
            (shard_dir / name).write_bytes(data)
            parts.append(
                {"name": name, "count": len(records), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            )
            completed.extend(f"{r.index}:{r.rollout_n}" for r in records)
            if checkpoint is not None:
                checkpoint(parts[-1], [f"{r.index}:{r.rollout_n}" for r in records])
        if checkpoint is None:
            legacy = {
                "parts": parts,
                "completed": completed,
                "failed": [],
                "response_tokens": 0,
                "generated_tokens": 0,
                "attempts": 1,
            }
            (shard_dir / "checkpoint.json").write_text(json.dumps(legacy))


def _checkpoint_writer(root: Path, shard: str):
    """commit(part, samples) through this generation_core's ShardCheckpoint, or None when it
    predates commit records (it reads one checkpoint.json per shard)."""
    from generation_core.store import run_folder

    if not hasattr(run_folder, "commit_file"):
        return None
    from generation_core.store.folder import StorageFolder

    try:
        from generation_core.store.commit_log import ShardCheckpoint
    except ImportError:  # a genrun from before commit_log.py: the checkpoint lived in run_folder
        ShardCheckpoint = run_folder.ShardCheckpoint

    folder = StorageFolder(str(root))
    checkpoint = ShardCheckpoint()
    return lambda part, samples: checkpoint.commit_part(folder, shard, run_folder.PartEntry(**part), samples)


def _record(record_type, rng, index: int, prompt_length: int, response_length: int):
    import numpy as np

    prompt_tokens = int(np.clip(rng.lognormal(np.log(120), 0.5), 8, prompt_length))
    response_tokens = int(np.clip(rng.lognormal(np.log(400), 0.8), 1, response_length))
    messages = [{"role": "user", "content": f"Question {index}: " + "lorem ipsum " * int(rng.integers(5, 40))}]
    return record_type(
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
    import generation_core.outputs.merge as merge
    import generation_core.store.run_folder as run_folder
    from generation_core.store.folder import StorageFolder

    folder = StorageFolder(directory)
    lengths = dict(prompt_length=prompt_length, response_length=response_length, pad_token_id=2)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    started = time.perf_counter()
    if chunk_size is None:
        data = merge.merge_run(folder, **lengths)
        rows = len(data)
        files = [run_folder.MERGED_FILE]
    else:
        merged = merge.merge_run_chunked(folder, chunk_size=chunk_size, **lengths)
        rows = merged.rows
        files = [chunk["name"] for chunk in folder.read_json(run_folder.CHUNK_INDEX_FILE)["chunks"]]
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


def _run_step(code_root: Path, step: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code_root))
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *step],
        env=env,
        cwd=str(code_root),
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"{' '.join(step[:1])} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(code_root: Path, scratch: Path, label: str, args) -> dict:
    folder = scratch / label
    sizes = [str(args.trajectories), str(args.prompt_length), str(args.response_length)]
    _run_step(code_root, ["--step-build", str(folder), *sizes])
    chunk = [] if args.chunk_size is None else ["--chunk-size", str(args.chunk_size)]
    result = _run_step(code_root, ["--step-merge", str(folder), *sizes, *chunk])
    shutil.rmtree(folder, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=20000)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--baseline", help="a git revision to measure the same way, side by side")
    parser.add_argument("--step-build", help=argparse.SUPPRESS)
    parser.add_argument("--step-merge", help=argparse.SUPPRESS)
    parser.add_argument("sizes", nargs="*", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_build:
        build_folder(args.step_build, *args.sizes)
        print(json.dumps({}))
        return
    if args.step_merge:
        print(json.dumps(measure_merge(args.step_merge, args.sizes[1], args.sizes[2], args.chunk_size)))
        return

    scratch = Path(tempfile.mkdtemp(prefix="genrun-merge-bench-"))
    try:
        results = {}
        if args.baseline:
            baseline_root = scratch / "baseline-code"
            baseline_root.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.baseline], check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(baseline_root)], input=archive, check=True)
            results[f"baseline {args.baseline}"] = measure(baseline_root, scratch, "baseline", args)
        results["current tree"] = measure(REPO, scratch, "current", args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    mib = 1 / (1 << 20)
    what = "largest chunk" if args.chunk_size else "trajectories.pkl"
    print(
        f"{args.trajectories} trajectories, prompt_length {args.prompt_length}, response_length {args.response_length}, chunk_size {args.chunk_size}"
    )
    for label, r in results.items():
        print(
            f"{label:>22}: {what} {r['largest_file'] * mib:8.1f} MiB ({r['files']} file(s), {r['total_bytes'] * mib:.1f} MiB in all), "
            f"merge peak {r['peak_bytes'] * mib:8.1f} MiB, {r['seconds']:.1f} s"
        )
    for label, r in results.items():
        if args.chunk_size:
            print(f"{label:>22}: merge peak / largest chunk = {r['peak_bytes'] / r['largest_file']:.2f}")
        print(
            f"{label:>22}: merge peak / {'all chunks' if args.chunk_size else what} = {r['peak_bytes'] / r['total_bytes']:.2f} (target <= {TARGET:.1f})"
        )


if __name__ == "__main__":
    sys.exit(main())
