"""Many shards: what Prefect and Ray cost per shard task, at 10, 100 and 1,000 shards (issue 16, item 8).

    .venv/bin/python bench/many_shards.py [--shards 10 100 1000] [--prompts 2000]

Each size is one `genrun` run as a user starts it (its own temporary Prefect server and local
Ray), with the instant engine (no model work) on the same small dataset split into N shards,
so what grows with N is the orchestration alone: a Prefect task run per shard (API calls, states,
its persisted result), a Ray task per shard, the shard job's fixed start (plan, tokenizer,
prompts, agent-loop worker, pool attach) and its marker. Printed per size, side by side:

- wall time of the command, and wall / shards;
- the marginal cost of a shard: (wall(N) - wall(smallest N)) / (N - smallest N);
- inside the shard task (GENRUN_TIMELINE marks): median seconds from the task body's start to
  its marker written, and from the flow's submission to the body's start (Prefect + Ray dispatch);
- distinct Ray worker pids over all shards (from each marker's `last_attempt.worker.pid`): fewer
  than the shards means workers are reused, so imports are paid per worker, not per shard;
- the driver's (the `genrun` process's) peak RSS, polled from /proc (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from genrun_process import GENRUN, REPO, genrun_env


def peak_rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def timeline_events(path: Path) -> list[tuple[str, str, int, float]]:
    """(event, argument, pid, unix time) for every `<event> [<argument>] pid=<pid> <time>` line."""
    events = []
    for line in path.read_text().splitlines():
        parts = line.split()
        pid = int(next(p for p in parts if p.startswith("pid="))[4:])
        events.append((parts[0], parts[1] if len(parts) == 4 else "", pid, float(parts[-1])))
    return events


def run_once(scratch: Path, prompts: Path, shards: int) -> dict:
    timeline = scratch / f"timeline-{shards}.txt"
    out = scratch / f"run-{shards}"
    command = [
        GENRUN,
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        f"generation.num_shards={shards}",
        "generation.show_progress=false",
        "generation.upload_artifact=false",
    ]
    started = time.time()
    process = subprocess.Popen(
        command, cwd=REPO, env=genrun_env(timeline), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak = [0]

    def poll() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], peak_rss_bytes(process.pid))
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, stderr = process.communicate()
    wall = time.time() - started
    poller.join()
    if process.returncode != 0:
        sys.exit(f"genrun with {shards} shards failed ({process.returncode}):\n{stderr[-3000:]}")
    markers = [json.loads(path.read_text()) for path in sorted((out / "shards").glob("*/_SUCCESS.json"))]
    events = timeline_events(timeline)
    ray_ready = next(t for name, _, _, t in events if name == "ray_ready")
    task_start = {arg: t for name, arg, _, t in events if name == "shard_task_start"}
    shard_done = {arg: t for name, arg, _, t in events if name == "shard_done"}
    merged = next(t for name, _, _, t in events if name == "merged")
    in_task = [shard_done[s] - task_start[s] for s in shard_done if s in task_start]
    return {
        "shards": shards,
        "wall": wall,
        "markers": len(markers),
        "trajectories": sum(m["num_trajectories"] for m in markers),
        "pids": len({m["last_attempt"]["worker"]["pid"] for m in markers}),
        "driver_peak": peak[0],
        "before_ray": ray_ready - started,
        "shard_phase": max(shard_done.values()) - ray_ready,
        "after_shards": merged - max(shard_done.values()),
        "in_task_median": statistics.median(in_task),
        "in_task_sum": sum(in_task),
        "first_task_start": min(task_start.values()) - ray_ready,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (timelines, run folders)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-many-shards-"))
    prompts = scratch / "prompts.parquet"
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": f"Question number {i}?"}],
            "extra_info": {"index": i},
        }
        for i in range(args.prompts)
    ]
    pq.write_table(pa.Table.from_pylist(rows), prompts)
    results = []
    try:
        for shards in args.shards:
            results.append(run_once(scratch, prompts, shards))
            r = results[-1]
            print(
                f"{shards} shards: {r['wall']:.1f} s, {r['markers']} markers, {r['trajectories']} trajectories, {r['pids']} worker pids",
                flush=True,
            )
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    base = results[0]
    mib = 1024 * 1024
    print(
        f"\n{args.prompts} prompts, instant engine, {Path(REPO).name} on {len(__import__('os').sched_getaffinity(0))} cores"
    )
    header = f"{'':44s}" + "".join(f"{r['shards']:>10d}" for r in results)
    print(header + "   (shards)")
    rows = [
        ("wall time of genrun (s)", lambda r: f"{r['wall']:.1f}"),
        ("  command -> Ray up (preflight, Prefect) (s)", lambda r: f"{r['before_ray']:.1f}"),
        ("  Ray up -> last shard marker (s)", lambda r: f"{r['shard_phase']:.1f}"),
        ("  last marker -> merged (s)", lambda r: f"{r['after_shards']:.1f}"),
        ("wall / shards (s)", lambda r: f"{r['wall'] / r['shards']:.3f}"),
        ("shard phase / shards (s)", lambda r: f"{r['shard_phase'] / r['shards']:.3f}"),
        (
            f"marginal s per shard vs {base['shards']} shards",
            lambda r: "-" if r is base else f"{(r['wall'] - base['wall']) / (r['shards'] - base['shards']):.3f}",
        ),
        ("shard task body, median (s)", lambda r: f"{r['in_task_median']:.3f}"),
        ("shard task bodies, sum (s)", lambda r: f"{r['in_task_sum']:.1f}"),
        ("distinct worker pids", lambda r: f"{r['pids']}"),
        ("driver peak RSS (MiB)", lambda r: f"{r['driver_peak'] / mib:.0f}"),
        ("trajectories", lambda r: f"{r['trajectories']}"),
    ]
    for label, value in rows:
        print(f"{label:44s}" + "".join(f"{value(r):>10s}" for r in results))


if __name__ == "__main__":
    main()
