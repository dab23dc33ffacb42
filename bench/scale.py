"""Scale: what a run costs as the dataset grows (issue 16), measured side by side in one sitting.

    .venv/bin/python bench/scale.py                      # 10k and 1M prompts, checkpoint bytes over 100k
    .venv/bin/python bench/scale.py --sizes 10000 1000000 3000000 10000000
    .venv/bin/python bench/scale.py --skip-first-part --skip-checkpoint --recheck-rows 10000000

`genrun` as a user starts it, instant engine, 16 shards, parts of 1,000 trajectories:
1. per dataset size, the preflight, the first committed part, the peak RSS of the driver and of the
   shard workers (bench/process_roles.py); the run is stopped 15 s after its first part;
2. checkpoint bytes over one 100k-prompt shard run to the end at the defaults (256 tokens, logprobs);
3. (`--recheck-rows N`) a resume's re-check of 16 finished shards' rows at N prompts, in process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from genrun_process import GENRUN, REPO, check_command, genrun_env
from process_roles import follow, stop_session

from generation_core.instrumentation import read_timeline

SHARDS = 16
TOPICS = ["the sea", "a cat", "rain", "mountains", "coffee", "a robot", "the moon", "trees"]


def write_dataset(path: Path, rows: int, row_group_size: int = 100_000) -> Path:
    """`rows` chat prompts in verl's layout, built column-wise (10M rows take seconds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = None
    for start in range(0, rows, row_group_size):
        stop = min(start + row_group_size, rows)
        count = stop - start
        content = pa.array(
            [f"Write one short sentence about {TOPICS[i % len(TOPICS)]} (#{i})." for i in range(start, stop)]
        )
        messages = pa.StructArray.from_arrays([pa.repeat("user", count), content], names=["role", "content"])
        prompt = pa.ListArray.from_arrays(pa.array(np.arange(count + 1, dtype=np.int32)), messages)
        reward = [pa.repeat("none", count), pa.repeat("", count)]
        extra_info = [pa.repeat("train", count), pa.array(np.arange(start, stop, dtype=np.int64))]
        table = pa.table(
            {
                "data_source": pa.repeat("scale", count),
                "prompt": prompt,
                "ability": pa.repeat("chat", count),
                "reward_model": pa.StructArray.from_arrays(reward, names=["style", "ground_truth"]),
                "extra_info": pa.StructArray.from_arrays(extra_info, names=["split", "index"]),
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=row_group_size)
    writer.close()
    return path


def first_part_arguments(dataset: Path, scratch: Path) -> list[str]:
    return [
        f"data.train_files=[{dataset}]",
        "actor_rollout_ref.rollout.name=instant",
        f"generation.num_shards={SHARDS}",
        "generation.save_batch_size=1000",
        "generation.show_progress=false",
        f"trainer.default_local_dir={scratch / 'run'}",
    ]


def time_to_first_part(dataset: Path, scratch: Path, after_first_part: float = 15.0) -> dict[str, float]:
    scratch.mkdir(parents=True, exist_ok=True)
    timeline, log = scratch / "timeline.txt", scratch / "out.log"
    started, first_part_at = time.time(), []

    def stop() -> bool:  # 15 s after the first part, or half an hour without one
        if not first_part_at and timeline.exists() and "first_part_written" in timeline.read_text():
            first_part_at.append(time.time())
        return time.time() - first_part_at[0] >= after_first_part if first_part_at else time.time() - started > 1800

    with log.open("w") as out:
        process = subprocess.Popen(
            [GENRUN, *first_part_arguments(dataset, scratch)],
            cwd=REPO,
            env=genrun_env(timeline),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            roles = follow(process, 0.1, until=stop).roles(started, time.time())
        finally:
            stop_session(process.pid)
            process.wait(timeout=60)
    events = read_timeline(timeline) if timeline.exists() else {}
    if "first_part_written" not in events:
        sys.exit(f"no part was committed; the run's output:\n{log.read_text()[-3000:]}")
    return {
        "inputs_checked_s": events["inputs_checked"][0] - started,
        "first_part_s": events["first_part_written"][0] - started,
        "driver_peak_rss_mib": roles["driver"]["peak_rss"] / 2**20,
        "shard_worker_peak_rss_mib": roles.get("shard worker", {}).get("peak_rss", 0) / 2**20,
    }


def checkpoint_arguments(dataset: Path, run: Path) -> list[str]:
    return [
        f"data.train_files=[{dataset}]",
        "actor_rollout_ref.rollout.name=instant",
        "actor_rollout_ref.rollout.engine_kwargs.instant.response_tokens=256",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "data.max_response_length=256",
        "generation.max_inflight=256",
        "generation.show_progress=false",
        "generation.final_merge=false",
        f"trainer.default_local_dir={run}",
    ]


def checkpoint_bytes(scratch: Path, prompts: int = 100_000) -> dict[str, float]:
    """One shard of `prompts` trajectories to the end at the default part settings."""
    dataset = write_dataset(scratch / "prompts.parquet", prompts)
    run, started = scratch / "run", time.time()
    command, env = [GENRUN, *checkpoint_arguments(dataset, run)], genrun_env(scratch / "timeline.txt")
    finished = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if finished.returncode != 0:
        sys.exit(f"the 100k run failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
    shard = run / "shards" / "shard-00000"
    commit_files = sorted((shard / "commits").glob("*.json"))
    part_files = sorted(shard.glob("*.parquet"))
    commit_bytes = sum(p.stat().st_size for p in commit_files)
    part_bytes = sum(p.stat().st_size for p in part_files)
    marker = json.loads((shard / "_SUCCESS.json").read_text())
    trajectories = marker["num_trajectories"]
    return {
        "seconds": time.time() - started,
        "trajectories": trajectories,
        "parts": len(part_files),
        "commit_records": len(commit_files),
        "part_bytes": part_bytes,
        "commit_bytes": commit_bytes,
        "ratio": commit_bytes / part_bytes,
        "part_bytes_per_trajectory": part_bytes / trajectories,
        "trajectories_per_second": trajectories / marker["last_attempt"]["seconds"],
    }


def recheck_rows(scratch: Path, prompts: int) -> dict[str, float]:
    """Phase 3: the resume-time re-read of every finished shard's rows."""
    import resource

    from generation_core.config.bundled import prepare_bundled_model
    from generation_core.inputs.dataset_location import data_storage_options
    from generation_core.inputs.shard_rows import read_rows, rows_digest
    from generation_core.preflight.preflight import preflight
    from generation_core.shard.finished import RECHECK_THREADS, finished_shards
    from generation_core.store.commit_log import ShardCheckpoint, write_marker
    from generation_core.store.run_folder import SuccessMarker

    started = time.time()
    dataset = write_dataset(scratch / "prompts.parquet", prompts)
    written = time.time() - started
    plan = preflight(
        [
            f"data.train_files=[{dataset}]",
            f"trainer.default_local_dir={scratch / 'run'}",
            f"actor_rollout_ref.model.path={prepare_bundled_model()}",
            "actor_rollout_ref.rollout.name=instant",
            f"generation.num_shards={SHARDS}",
        ]
    )
    plan.claim_folder()
    options = data_storage_options(plan.cfg)
    started = time.time()
    for shard in plan.shards:
        rows = read_rows(plan.dataset, shard.start, shard.end, options)
        ShardCheckpoint.start_attempt(plan.folder, shard.name, rows_digest=rows_digest(rows))
    recorded = time.time() - started
    for shard in plan.shards:  # finished (no parts): only a finished shard's rows are read again
        marker = SuccessMarker(shard.name, shard.shard_id, [shard.start, shard.end], 0, expected_trajectories=0)
        write_marker(plan.folder, marker)
    started = time.time()
    assert all(finished_shards(plan, plan.shards).values())
    return {
        "dataset_mib": dataset.stat().st_size / 2**20,
        "dataset_written_s": written,
        "digests_recorded_one_by_one_s": recorded,
        "recheck_all_finished_shards_s": time.time() - started,
        "threads": RECHECK_THREADS,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def first_part_table(sizes: list[int], tmp: Path) -> None:
    results = {}
    for rows in sizes:
        started = time.time()
        dataset = write_dataset(tmp / f"data-{rows}" / "prompts.parquet", rows)
        mib = dataset.stat().st_size / 2**20
        print(f"{rows:>10,} prompts: dataset written in {time.time() - started:.1f} s ({mib:.0f} MiB)", flush=True)
        results[rows] = time_to_first_part(dataset, tmp / f"run-{rows}")
        print(f"{rows:>10,} prompts: " + ", ".join(f"{k} {v:.1f}" for k, v in results[rows].items()), flush=True)
        dataset.unlink()
    base = results[min(results)]
    print("\n   prompts  preflight s  first part s  vs smallest  driver RSS MiB  shard worker RSS MiB  vs smallest")
    for rows, r in results.items():
        first, worker = r["first_part_s"], r["shard_worker_peak_rss_mib"]
        print(
            f"{rows:>10,}  {r['inputs_checked_s']:11.1f}  {first:12.1f}  {first / base['first_part_s']:11.2f}"
            f"  {r['driver_peak_rss_mib']:14.0f}  {worker:20.0f}  {worker / base['shard_worker_peak_rss_mib']:11.2f}"
        )


def print_figures(title: str, figures: dict, digits: int) -> None:
    print(title)
    for key, value in figures.items():
        print(f"  {key}: {value:,.{digits}f}" if isinstance(value, float) else f"  {key}: {value:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--skip-checkpoint", action="store_true")
    parser.add_argument("--skip-first-part", action="store_true")
    parser.add_argument("--recheck-rows", type=int, default=0, metavar="N", help="phase 3 at N prompts (0: skipped)")
    parser.add_argument("--smoke", action="store_true", help="seconds: genrun's checks of both runs, phase 3 at 400")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="genrun-scale-") as tmp:
        tmp = Path(tmp)
        if args.smoke:
            dataset = write_dataset(tmp / "prompts.parquet", 200, row_group_size=64)
            check_command(first_part_arguments(dataset, tmp / "first-part"))
            check_command(checkpoint_arguments(dataset, tmp / "checkpoint"))
            args.skip_first_part = args.skip_checkpoint = True
            args.recheck_rows = 400
        if not args.skip_first_part:
            first_part_table(args.sizes, tmp)
        if not args.skip_checkpoint:
            figures = checkpoint_bytes(tmp / "checkpoint")
            title = "one shard, 100k prompts, defaults (parts by size and age), 256 response tokens with logprobs:"
            print_figures("\n" + title, figures, 4)
            per_million = 1_000_000 * figures["part_bytes_per_trajectory"] / (64 << 20)
            print(f"  files per 1M trajectories at 64 MiB parts: {per_million:.0f} parts (+ as many commit records)")
            print(f"  checkpoint bytes / part bytes: {figures['ratio']:.4%} (target <= 2%)")
        if args.recheck_rows:
            title = f"re-checking the rows of {SHARDS} finished shards, {args.recheck_rows:,} prompts:"
            print_figures("\n" + title, recheck_rows(tmp / "recheck", args.recheck_rows), 1)


if __name__ == "__main__":
    main()
