"""The genrun side of `genrun bench`: one whole `genrun` run (Prefect flow, Ray, shard tasks,
agent loops, parts, merge) in a subprocess, on the bench's prompts, every response run to the
same length (verl's `actor_rollout_ref.rollout.ignore_eos=true`, which genrun sends with every
request).

Its figure is the generation phase (issue 6's pipeline efficiency, bench/RESULTS.md): tokens over
(first shard worker ready with the engine up -> last shard done), from the run's timeline
(generation_core/instrumentation.py); the whole command's wall time is reported beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from generation_core.errors import GenrunError


def override_key(override: str) -> str:
    """The key an override sets (`+key=value`, `key=value`)."""
    return override.lstrip("+").split("=")[0]


def genrun_run(overrides: list[str], prompts_file: Path, tokens: int, folder: Path) -> tuple[int, float, float]:
    """(generated tokens, generation-phase seconds, wall seconds) of one whole `genrun` run."""
    from generation_core.instrumentation import TIMELINE_ENV, generation_phase_seconds, read_timeline

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
    with log.open("w") as out:
        finished = subprocess.run(
            [sys.executable, "-m", "flows.cli", *overrides, *fixed], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    wall = time.perf_counter() - started
    if finished.returncode != 0:
        tail = log.read_text()[-2000:]
        raise GenrunError(f"the genrun run of the bench failed (exit {finished.returncode}); its log: {log}\n{tail}")
    manifest = json.loads((folder / "manifest.json").read_text())
    return int(manifest["generated_tokens"]), generation_phase_seconds(read_timeline(timeline)), wall
