"""Storage: bytes on disk of part files per trajectory, next to the raw token bytes.

    .venv/bin/python bench/storage.py [RUN_FOLDER ...] [--baseline GIT_REV]

Each RUN_FOLDER is a genrun output folder; its committed parts (real generations) are read
and written again, part by part with the same trajectories in each, by the current
`records_to_parquet` and, with --baseline, by that revision's (side by side, same records);
a run with logprobs is measured a second time with them dropped (same tokens, logprobs off).
Without folders, a run of the bundled model on the bundled prompts is generated first (a few
minutes on a 2-core CPU):

    genrun data.max_response_length=256 generation.show_progress=false \\
        actor_rollout_ref.rollout.calculate_log_probs=true trainer.default_local_dir=DIR

Figures per folder: raw int32 token bytes (4 x (prompt + response tokens)), part bytes, and
the bytes per trajectory of the padded DataProto pickle at response_length 4096 (prompt length
as the run configured it). Every re-written part is read back and compared with the records it
was written from (logprobs bit-exact). The target ratio (parts / raw tokens <= 1.3) is printed last.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The padded size is measured with the tests' in-memory merge oracle (tests/merge_oracles.py).
sys.path.insert(0, str(REPO))
TARGET = 1.3
PADDED_RESPONSE_LENGTH = 4096
PART_SIZE = 16  # generation.save_batch_size's default


def generate(directory: Path, logprobs: bool) -> None:
    command = [
        str(Path(sys.executable).parent / "genrun"),
        "data.max_response_length=256",
        "generation.show_progress=false",
        f"actor_rollout_ref.rollout.calculate_log_probs={str(logprobs).lower()}",
        f"trainer.default_local_dir={directory}",
    ]
    subprocess.run(command, check=True, cwd=str(REPO), stdout=subprocess.DEVNULL)


def part_records(directory: Path) -> list[list]:
    """The records of each committed part of a run folder, part by part."""
    from generation_core.store.folder import StorageFolder
    from generation_core.store.part_repair import committed_parts, read_verified_part
    from generation_core.store.trajectory_record import records_from_parquet

    folder = StorageFolder(str(directory))
    return [records_from_parquet(read_verified_part(folder, p)) for p in committed_parts(folder)]


def baseline_records_module(revision: str, scratch: Path):
    """That revision's records.py, loaded on its own (it imports nothing from genrun)."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:generation_core/store/trajectory_record.py"],
        check=True,
        capture_output=True,
    ).stdout
    path = scratch / "baseline_records.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("baseline_records", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def padded_pickle_bytes(records: list, prompt_length: int) -> int:
    from generation_core.outputs.merge import dump_dataproto
    from tests.merge_oracles import build_dataproto

    data = build_dataproto(records, prompt_length=prompt_length, response_length=PADDED_RESPONSE_LENGTH, pad_token_id=2)
    size, _ = dump_dataproto(data, io.BytesIO())
    return size


def without_logprobs(parts: list[list]) -> list[list]:
    import dataclasses

    return [[dataclasses.replace(r, response_logprobs=None) for r in part] for part in parts]


def regrouped(parts: list[list], size: int) -> list[list]:
    """The same trajectories in commit order, in parts of `size` (generation.save_batch_size):
    what a run commits when no part is cut early by pull_timeout."""
    records = [r for part in parts for r in part]
    return [records[start : start + size] for start in range(0, len(records), size)]


def part_bytes(parts: list[list], write) -> int:
    return sum(len(write(part)) for part in parts)


def breakdown(parts: list[list]) -> dict[str, int]:
    """Bytes of the current parts by what they hold: token ids, logprobs, the other columns,
    and per-file overhead (footer, page headers, magic)."""
    import pyarrow.parquet as pq

    from generation_core.store.trajectory_record import records_to_parquet

    sizes = {"token ids": 0, "logprobs": 0, "other columns": 0, "file overhead": 0}
    for part in parts:
        data = records_to_parquet(part)
        group = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
        columns = [group.column(i) for i in range(group.num_columns)]
        for column in columns:
            name = column.path_in_schema
            kind = (
                "token ids"
                if name.split(".")[0] in ("prompt_ids", "response_ids")
                else "logprobs"
                if name.startswith("response_logprobs")
                else "other columns"
            )
            sizes[kind] += column.total_compressed_size
        sizes["file overhead"] += len(data) - sum(column.total_compressed_size for column in columns)
    return sizes


def measure(directory: Path, parts: list[list], baseline) -> dict:
    import json

    from generation_core.store.trajectory_record import records_from_parquet, records_to_parquet

    records = [r for part in parts for r in part]
    for part in parts:
        back = records_from_parquet(records_to_parquet(part))
        if [r.__dict__ for r in back] != [r.__dict__ for r in part]:
            raise SystemExit(f"{directory}: a part does not read back as the records it was written from")
    run = json.loads((directory / "run.json").read_text())
    groupings = {"as committed": parts, f"parts of {PART_SIZE}": regrouped(parts, PART_SIZE)}
    result = {
        "trajectories": len(records),
        "parts": [len(part) for part in parts],
        "tokens": sum(len(r.prompt_ids) + len(r.response_ids) for r in records),
        "response_tokens": sum(len(r.response_ids) for r in records),
        "logprobs": records[0].response_logprobs is not None,
        "current": {label: part_bytes(grouping, records_to_parquet) for label, grouping in groupings.items()},
        "breakdown": breakdown(groupings[f"parts of {PART_SIZE}"]),
        "padded": padded_pickle_bytes(records, run["config"]["actor_rollout_ref"]["rollout"]["prompt_length"]),
    }
    if baseline is not None:
        result["baseline"] = {
            label: part_bytes(grouping, baseline.records_to_parquet) for label, grouping in groupings.items()
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument(
        "--baseline", help="a git revision whose records_to_parquet writes the same records, side by side"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="genrun-storage-bench-") as scratch:
        folders = list(args.folders)
        if not folders:
            folders.append(Path(scratch) / "run")
            generate(folders[-1], logprobs=True)
        baseline = baseline_records_module(args.baseline, Path(scratch)) if args.baseline else None
        results = []
        for folder in folders:
            parts = part_records(folder)
            results.append((folder, measure(folder, parts, baseline)))
            if parts[0][0].response_logprobs is not None:
                results.append((folder, measure(folder, without_logprobs(parts), baseline)))

    for folder, r in results:
        n, raw = r["trajectories"], 4 * r["tokens"]
        logprobs = "on" if r["logprobs"] else "off"
        print(
            f"{folder}, logprobs {logprobs}: {n} trajectories of {r['tokens'] / n:.0f} tokens ({r['response_tokens'] / n:.0f} response), raw int32 tokens {raw / n:.0f} B/trajectory"
        )
        print(f"  trajectories per part as committed: {r['parts']}")
        for label in r["current"]:
            before = (
                f"baseline {args.baseline} {r['baseline'][label] / n:6.0f} B/trajectory = {r['baseline'][label] / raw:.2f}x raw, "
                if "baseline" in r
                else ""
            )
            print(
                f"  {label:>14}: {before}current {r['current'][label] / n:6.0f} B/trajectory = {r['current'][label] / raw:.2f}x raw"
            )
        parts_of = r["current"][f"parts of {PART_SIZE}"]
        print(
            f"  parts of {PART_SIZE}, bytes per trajectory: "
            + ", ".join(f"{kind} {size / n:.0f}" for kind, size in r["breakdown"].items())
        )
        print(
            f"  padded DataProto pickle at response_length {PADDED_RESPONSE_LENGTH}: {r['padded'] / n:.0f} B/trajectory; parts of {PART_SIZE} are {parts_of / r['padded']:.4f} of it"
        )
    for _, r in results:
        raw = 4 * r["tokens"]
        figures = ", ".join(f"{label} {size / raw:.2f}" for label, size in r["current"].items())
        print(
            f"parts / raw int32 token bytes, logprobs {'on' if r['logprobs'] else 'off'}: {figures} (target <= {TARGET})"
        )


if __name__ == "__main__":
    sys.exit(main())
