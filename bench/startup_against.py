"""The demo's startup, this tree against an earlier commit, runs alternating in one sitting.

    .venv/bin/python -u bench/startup_against.py REV [--rounds 2]

bench/startup.py times one tree; this machine's speed drifts too much between sittings for two
of its runs on different days to compare. Here each round runs the demo command (the bundled
defaults, a temporary Prefect server, `generation.show_progress=false`) once with REV's code (a
temporary git worktree) and once with this tree's, each as `python -m flows.cli` with
`PYTHONPATH` on its tree (Ray's workers inherit it) and `GENRUN_TIMELINE` set. Both use this
tree's virtual environment. Printed: seconds from the command's start to each stage, and the
means of both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from genrun_process import REPO, genrun_env, read_timeline

PYTHON = str(REPO / ".venv" / "bin" / "python")
STAGES = ["inputs_checked", "engine_ready", "first_part_written", "merged"]


def run_demo(tree: Path, scratch: Path) -> dict[str, float]:
    """Seconds from the command's start to each stage, and to its exit ("exit")."""
    timeline = scratch / "timeline"
    env = dict(genrun_env(timeline), PYTHONPATH=str(tree))
    started = time.time()
    finished = subprocess.run([PYTHON, "-m", "flows.cli", f"trainer.default_local_dir={scratch / 'out'}", "generation.show_progress=false"], cwd=tree, env=env, capture_output=True, text=True)
    ended = time.time() - started
    if finished.returncode != 0:
        sys.exit(f"the demo failed in {tree} ({finished.returncode}):\n{finished.stderr[-3000:]}")
    events = read_timeline(timeline)
    return {stage: events[stage][0] - started for stage in STAGES} | {"exit": ended}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the earlier commit (anything `git worktree add` takes)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-startup-against-"))
    earlier = scratch / "earlier-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(earlier), args.rev], check=True)
    trees = {args.rev: earlier, "this tree": REPO}
    times: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                folder = scratch / f"{round_}-{len(times[name])}-{tree.name}"
                folder.mkdir()
                times[name].append(run_demo(tree, folder))
                shutil.rmtree(folder / "out", ignore_errors=True)
                print(f"round {round_ + 1} {name:>12}: " + "  ".join(f"{k} {v:5.1f}" for k, v in times[name][-1].items()), flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    for name, runs in times.items():
        print(f"mean {name:>12}: " + "  ".join(f"{k} {sum(r[k] for r in runs) / len(runs):5.1f}" for k in runs[0]))


if __name__ == "__main__":
    main()
