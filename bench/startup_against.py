"""The demo's startup, this tree against an earlier commit, runs alternating in one sitting.

    .venv/bin/python -u bench/startup_against.py REV [--rounds 2]

bench/startup.py times one tree; this machine's speed drifts too much between sittings for two
of its runs on different days to compare. Here each round runs the demo command (bench/startup.py's
`run_once`: the bundled defaults, a temporary Prefect server) once with REV's code (a temporary
git worktree) and once with this tree's, both as `python -m flows.cli` with this tree's virtual
environment. Printed: seconds from the command's start to each stage, and the means of both.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from genrun_process import REPO
from startup import run_once

STAGES = ["inputs_checked", "engine_ready", "first_part_written", "merged", "done"]


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
                folder = scratch / f"{round_}-{tree.name}"
                folder.mkdir()
                timeline = run_once(folder, tree)
                times[name].append({stage: timeline[stage] for stage in STAGES})
                shutil.rmtree(folder, ignore_errors=True)
                print(
                    f"round {round_ + 1} {name:>12}: " + "  ".join(f"{k} {v:5.1f}" for k, v in times[name][-1].items()),
                    flush=True,
                )
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    for name, runs in times.items():
        print(f"mean {name:>12}: " + "  ".join(f"{k} {sum(r[k] for r in runs) / len(runs):5.1f}" for k in STAGES))


if __name__ == "__main__":
    main()
