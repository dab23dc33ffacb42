"""What per-trajectory provenance and timings cost (issue 35, item 1): trajectories/s on the
instant engine and part bytes, this tree against a baseline revision, side by side in one run.

    .venv/bin/python bench/provenance_cost.py --baseline GIT_REV [--samples 2000] [--sittings 3] [RUN_FOLDER]

Throughput: bench/orchestration.py's run (the instant engine, one shard, in process) in a fresh
interpreter per sitting, alternating the baseline's tree (`git archive GIT_REV`) and this one,
so both see the same machine load; the median of each side and their ratio are printed.

Bytes: the committed parts of RUN_FOLDER (a run written by this tree, so its records carry
provenance; without one, the throughput run's own parts of this tree), written again part by
part by this tree's `records_to_parquet` and by the same records with provenance and timings
dropped (what the baseline stores); bytes per trajectory and the ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# One sitting: the orchestration run, its rate printed as JSON on the last line; the run folder kept.
_SITTING = """
import json, os, sys, tempfile
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
scratch = Path(sys.argv[2])
os.environ.setdefault("HF_DATASETS_CACHE", str(scratch / "hf"))
rows = [{"data_source": "bench", "prompt": [{"role": "user", "content": f"Question number {i}?"}], "extra_info": {"index": i}} for i in range(int(sys.argv[1]))]
pq.write_table(pa.Table.from_pylist(rows), scratch / "prompts.parquet")
from generation_core.driver.in_process import run_in_process
from generation_core.preflight.preflight import preflight
summary = run_in_process(preflight([
    f"data.train_files={scratch / 'prompts.parquet'}", f"trainer.default_local_dir={scratch / 'run'}",
    "actor_rollout_ref.rollout.name=instant", "generation.show_progress=false",
    "generation.save_batch_size=500", "generation.max_inflight=256", "actor_rollout_ref.rollout.engine_kwargs.instant.response_tokens=64",
]))
now = summary["this_invocation"]
print(json.dumps({"rate": now["trajectories"] / now["generation_seconds"]}))
"""


def baseline_tree(revision: str, scratch: Path) -> Path:
    tree = scratch / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def sitting(tree: Path, samples: int, scratch: Path) -> float:
    scratch.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", _SITTING, str(samples), str(scratch)],
        cwd=str(tree),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"sitting in {tree} failed:\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["rate"])


def part_bytes(folder: Path) -> tuple[int, int, int]:
    """(trajectories, bytes with provenance, bytes without) of the folder's parts written again."""
    from generation_core.store.folder import StorageFolder
    from generation_core.store.part_repair import committed_parts, read_verified_part
    from generation_core.store.trajectory_record import records_from_parquet, records_to_parquet

    run = StorageFolder(str(folder))
    count = with_ = without = 0
    for part in committed_parts(run):
        records = records_from_parquet(read_verified_part(run, part))
        assert all(r.provenance is not None for r in records), (
            f"{part.path} was written without provenance: give a run folder of this tree"
        )
        count += len(records)
        with_ += len(records_to_parquet(records))
        for record in records:
            record.provenance = record.timings = None
        without += len(records_to_parquet(records))
    return count, with_, without


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "folder", nargs="?", type=Path, help="a run folder written by this tree (bytes measured on its parts)"
    )
    parser.add_argument("--baseline", required=True, help="git revision without provenance (e.g. the merge base)")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--sittings", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-provenance-"))
    base = baseline_tree(args.baseline, scratch)
    rates: dict[str, list[float]] = {"baseline": [], "provenance": []}
    for n in range(args.sittings):
        rates["baseline"].append(sitting(base, args.samples, scratch / f"base-{n}"))
        rates["provenance"].append(sitting(REPO, args.samples, scratch / f"this-{n}"))
    for name, values in rates.items():
        print(
            f"instant engine, {args.samples} samples: {name:10s} "
            + " ".join(f"{v:6.0f}" for v in values)
            + f"  median {statistics.median(values):6.0f} trajectories/s"
        )
    print(
        f"trajectories/s with provenance / without: {statistics.median(rates['provenance']) / statistics.median(rates['baseline']):.3f}"
    )
    folder = args.folder or scratch / f"this-{args.sittings - 1}" / "run"
    count, with_, without = part_bytes(folder)
    print(
        f"part bytes ({folder if args.folder else 'the instant run'}; {count} trajectories): with provenance {with_ / count:.1f} B/trajectory, "
        f"without {without / count:.1f} B/trajectory, ratio {with_ / without:.3f} (+{(with_ - without) / count:.1f} B/trajectory)"
    )


if __name__ == "__main__":
    sys.exit(main())
