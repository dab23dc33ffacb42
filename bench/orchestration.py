"""Orchestration cost: trajectories/s of one shard with the instant engine (no model work).

    .venv/bin/python bench/orchestration.py [--samples 2000]

The instant engine (actor_rollout_ref.rollout.name=instant) answers every request at once, so the
figure is what the pipeline itself costs per trajectory: verl agent loop, engine round trip
through Ray, record building, Parquet parts and checkpoints. Runs in one process without Prefect
(the shard code is the same a Prefect shard task runs); the rate is printed last, next to the
issue's target of 500/s, after the per-stage breakdown from the shard's marker: postprocess
(agent-loop output -> record), serialization (records -> Parquet), storage (part and checkpoint
writes, in a thread beside generation) and the rest of the shard's wall time, which is the
agent loops themselves (chat template, tokenization, the engine's Ray round trip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TARGET = 500.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-bench-"))
    os.environ.setdefault("HF_DATASETS_CACHE", str(scratch / "hf"))
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": f"Question number {i}?"}],
            "extra_info": {"index": i},
        }
        for i in range(args.samples)
    ]
    pq.write_table(pa.Table.from_pylist(rows), scratch / "prompts.parquet")
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    try:
        plan = preflight(
            [
                f"data.train_files={scratch / 'prompts.parquet'}",
                f"trainer.default_local_dir={scratch / 'run'}",
                "actor_rollout_ref.rollout.name=instant",
                "generation.show_progress=false",
                "generation.save_batch_size=500",
                "generation.max_inflight=256",
            ]
        )
        summary = run_in_process(plan)
        marker = json.loads(next((scratch / "run" / "shards").glob("*/_SUCCESS.json")).read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    now = summary["this_invocation"]
    rate = now["trajectories"] / now["generation_seconds"]
    print(f"trajectories: {now['trajectories']} in {now['generation_seconds']:.2f} s of shard time")
    stages = marker["last_attempt"]["stage_seconds"]
    shard_seconds = now["generation_seconds"]
    rest = shard_seconds - stages["postprocess"] - stages["serialization"]
    rows = [
        ("agent loop + engine round trip (rest)", rest),
        *((name, stages[name]) for name in ("postprocess", "serialization", "storage")),
    ]
    for name, seconds in rows:
        print(
            f"  {name:38s} {1000 * seconds / now['trajectories']:7.3f} ms/trajectory  {100 * seconds / shard_seconds:5.1f}% of shard time"
        )
    print(f"orchestration rate: {rate:.0f} trajectories/s (target {TARGET:.0f}/s: {rate / TARGET:.2f} of target)")


if __name__ == "__main__":
    sys.exit(main())
