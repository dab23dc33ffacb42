"""The genrun side of `genrun bench`: one whole `genrun` run (Prefect flow, Ray, shard tasks,
agent loops, parts, merge) in a subprocess, on the bench's prompts, every response run to the
same length (verl's `actor_rollout_ref.rollout.ignore_eos=true`, which genrun sends with every
request).

Its figure is the generation phase (issue 6's pipeline efficiency, bench/RESULTS.md): tokens over
(first shard worker ready with the engine up -> last shard done), from the run's timeline
(generation_core/instrumentation.py); the whole command's wall time is reported beside it, and
genrun's own CPU per trajectory over the same phase (process_cpu.py: its processes followed while
it runs, the engine's server actors left out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from generation_core.benchmark.process_cpu import GENRUN_OWN_ROLES, PROC_READABLE, follow
from generation_core.errors import GenrunError


def override_key(override: str) -> str:
    """The key an override sets (`+key=value`, `key=value`)."""
    return override.lstrip("+").split("=")[0]


class GenrunRun(NamedTuple):
    tokens: int
    generation_seconds: float
    wall_seconds: float
    trajectories: int
    own_cpu_us_per_trajectory: float | None
    """CPU microseconds of genrun's own processes (GENRUN_OWN_ROLES) over the generation phase per
    trajectory; None where /proc cannot be read (or the run finished no trajectory)."""


def genrun_run(overrides: list[str], prompts_file: Path, tokens: int, folder: Path) -> GenrunRun:
    """One whole `genrun` run, its processes followed while it runs."""
    from generation_core.instrumentation import TIMELINE_ENV, generation_phase, read_timeline

    timeline = folder.with_suffix(".timeline")
    env = dict(os.environ, **{TIMELINE_ENV: str(timeline)})
    env.pop("PREFECT_API_URL", None)  # its own temporary server, as a user's first run
    # The bench's subset of the dataset stands in for data.train_files (the source of its prompts).
    overrides = [item for item in overrides if override_key(item) != "data.train_files"]
    fixed = [
        f"data.train_files={prompts_file}",
        f"data.max_response_length={tokens}",
        f"trainer.default_local_dir={folder}",
        "generation.show_progress=false",
    ]
    # Every response runs to --tokens, as on the engine side (every engine honours it).
    fixed.append("actor_rollout_ref.rollout.ignore_eos=true")
    log = folder.with_suffix(".log")
    started = time.perf_counter()
    command = [sys.executable, "-m", "flows.cli", *overrides, *fixed]
    # Ctrl-C reaches the run too (the same process group), which stops as a user's run does.
    with log.open("w") as out, subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT) as child:
        processes = follow(child, 0.2) if PROC_READABLE else None
    wall = time.perf_counter() - started
    if child.returncode != 0:
        tail = log.read_text()[-2000:]
        raise GenrunError(f"the genrun run of the bench failed (exit {child.returncode}); its log: {log}\n{tail}")
    manifest = json.loads((folder / "manifest.json").read_text())
    phase_start, phase_end = generation_phase(read_timeline(timeline))
    trajectories = int(manifest["num_trajectories"])
    own_cpu = None
    if processes is not None and trajectories:
        own_cpu = processes.cpu_seconds(GENRUN_OWN_ROLES, phase_start, phase_end) / trajectories * 1e6
    return GenrunRun(int(manifest["generated_tokens"]), phase_end - phase_start, wall, trajectories, own_cpu)
