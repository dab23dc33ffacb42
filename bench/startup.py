"""Time from command to the first committed part of `make demo`, with its breakdown (issue 6, target 7).

    .venv/bin/python bench/startup.py
    .venv/bin/python bench/startup.py --refusals     # CPU seconds of a refused input (target 2 s)
    .venv/bin/python bench/startup.py --smoke        # one refusal, and genrun's checks of the demo command

Runs the demo command (`genrun` on the bundled defaults) into a scratch folder with
`GENRUN_TIMELINE` set: each process of the run records when it reached each stage
(generation_core/instrumentation.py), from the command's start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from subprocess import DEVNULL

from genrun_process import GENRUN, REPO, check_command, genrun_env

from generation_core.instrumentation import read_timeline

TARGET = 45.0  # issue 51: the first part of `make demo` on a quiet machine
STAGES = [
    ("first_line", "python start, genrun's first line (before the checks' imports)"),
    ("inputs_checked", "imports, input checks (config, data, model files, tokenizer, the run's code)"),
    ("prefect_api_ready", "Ray's start; the temporary Prefect server, launched after the light checks, answers"),
    ("ray_ready", "flow run created, Ray started"),
    ("engine_ready", "engine replica: actor start + model load"),
    ("shard_worker_ready", "shard task on a Ray worker: imports, tokenizer, prompts, agent loop setup"),
    ("first_part_written", "first part committed (cut by age: generation.first_part_max_seconds)"),
]
REFUSAL_TARGET_CPU = 2.0
REFUSALS = [
    ("typo'd key", ["actor_rollout_ref.rollout.temprature=0"]),
    ("missing data file", ["data.train_files=/no/such/prompts.parquet"]),
    ("missing column", ["data.prompt_key=no_such_column"]),
]


def demo_arguments(scratch: Path) -> list[str]:
    """The demo's own settings, into a scratch folder."""
    return [f"trainer.default_local_dir={scratch / 'run'}"]


def run_once(scratch: Path) -> dict[str, float]:
    """Seconds from the command's start to each stage of the timeline (its first mark: the first
    shard worker, the first part of any shard), and to the command's end ("done")."""
    timeline = scratch / "timeline.txt"
    started = time.time()
    finished = subprocess.run(
        [GENRUN, *demo_arguments(scratch)], cwd=REPO, env=genrun_env(timeline), capture_output=True, text=True
    )
    total = time.time() - started
    if finished.returncode != 0:
        sys.exit(f"the demo command failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
    return {name: stamps[0] - started for name, stamps in read_timeline(timeline).items()} | {"done": total}


def time_refusals(refusals: list[tuple[str, list[str]]], scratch: Path) -> None:
    """How long a newcomer waits for a refused input (issue 45 item 3)."""
    env = genrun_env(scratch / "timeline.txt")
    for label, arguments in refusals:
        started = time.time()
        command = [GENRUN, *arguments, *demo_arguments(scratch)]
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=DEVNULL, stderr=DEVNULL)
        _, status, usage = os.wait4(process.pid, 0)  # CPU of the command and its children
        code, wall, cpu = os.waitstatus_to_exitcode(status), time.time() - started, usage.ru_utime + usage.ru_stime
        if code != 2:
            sys.exit(f"genrun {' '.join(arguments)} exited {code}, not 2 (a refusal)")
        verdict = f"target {REFUSAL_TARGET_CPU} s CPU: " + ("met" if cpu <= REFUSAL_TARGET_CPU else "not met")
        print(f"refused {label:18s} {cpu:5.2f} s CPU  {wall:5.2f} s wall  ({verdict})")


def print_run(result: dict[str, float]) -> None:
    previous = 0.0
    for name, label in STAGES:
        if name not in result:
            continue  # a genrun from before the stage was marked (first_line: issue 51)
        print(f"  {result[name]:6.1f} s  (+{result[name] - previous:5.1f})  {label}")
        previous = result[name]
    print(f"  {result['done']:6.1f} s            whole demo finished (merge, zip included)")
    first, verdict = result["first_part_written"], "met" if result["first_part_written"] <= TARGET else "not met"
    print(f"time from command to first committed part: {first:.1f} s (target {TARGET:.0f} s: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refusals", action="store_true", help="time refused inputs only (no run)")
    parser.add_argument("--smoke", action="store_true", help="one refusal, the demo command checked, no run")
    args = parser.parse_args()
    if not (args.refusals or args.smoke):
        with tempfile.TemporaryDirectory(prefix="genrun-startup-", ignore_cleanup_errors=True) as scratch:
            return print_run(run_once(Path(scratch)))
    with tempfile.TemporaryDirectory(prefix="genrun-refusal-") as scratch:
        time_refusals(REFUSALS[:1] if args.smoke else REFUSALS, Path(scratch))
        if args.smoke:
            check_command(demo_arguments(Path(scratch)))


if __name__ == "__main__":
    main()
