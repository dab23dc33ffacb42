"""Is this shard finished? One decision (`is_finished`, pure, over the shard's folded commit
records and its marker), asked by the shard job before any work (after its repair), by the flow
for every shard as a run starts (`finished_shards`, handed on to Prefect's cache policy:
tasks/run_shard.py `shard_task`) and by a finished run's rerun (driver/finished_run.py). Only the
job repairs; the answer itself never writes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeGuard

from generation_core.errors import InputChanged
from generation_core.inputs.dataset_location import data_storage_options
from generation_core.inputs.shard_rows import read_rows, rows_digest
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.store.commit_log import ShardCheckpoint, marker_stands, read_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseFence
from generation_core.store.part_repair import size_damage
from generation_core.store.run_folder import COMMITS_DIR, SuccessMarker, shard_file

# Shards decided at once by `finished_shards` (the flow, as a run starts): object stores answer
# many listings and range requests in parallel; each thread holds at most one shard's rows.
RECHECK_THREADS = 8


class FinishedRowsChanged(InputChanged):
    """A finished shard's dataset rows changed since it was generated: its trajectories belong to
    other prompts and are not reused (built by `of`, which keeps the shard and both digests)."""

    shard: ShardSpec
    current: str
    recorded: str

    @classmethod
    def of(
        cls, folder: StorageFolder, shard: ShardSpec, current: str, recorded: str, others: list[str] | None = None
    ) -> FinishedRowsChanged:
        """The refusal: names the (first) shard, its digests and where the recorded one is;
        `others`: more shards refused at once. The message is the exception's only argument, so
        it pickles like any exception (a shard job's error crosses from a Ray worker)."""
        others = others or []
        more = (
            f" (and {', '.join(others[:5])}{f' and {len(others) - 5} more' if len(others) > 5 else ''})"
            if others
            else ""
        )
        refusal = cls(
            f"the dataset rows of finished {shard.name}{more} changed since it was generated (digest {current[:12]}, recorded "
            f"{recorded[:12]} in {folder.display(shard_file(shard.name, COMMITS_DIR))}): its trajectories belong to other prompts "
            "and are not reused. Restore the dataset as it was, or write to another trainer.default_local_dir"
        )
        refusal.shard, refusal.current, refusal.recorded = shard, current, recorded
        return refusal


def is_finished(
    marker: SuccessMarker | None, checkpoint: ShardCheckpoint, part_sizes: Mapping[str, int] | None = None
) -> TypeGuard[SuccessMarker]:
    """The one decision, pure: the shard has nothing left to do. Its success marker (as read)
    stands for its commit records (`checkpoint`, folded: `marker_stands`), records no failed
    samples (a later run retries those), and, given `part_sizes` (one listing of the shard's
    folder), every committed part is there at its recorded size. The shard job reads every part
    first (its repair) and asks without sizes; the readers ask with them (`finished_marker`)."""
    if marker is None or not marker_stands(marker, checkpoint) or marker.failures:
        return False
    return part_sizes is None or not any(size_damage(part, part_sizes) for part in checkpoint.parts)


def finished_marker(folder: StorageFolder, shard: str, checkpoint: ShardCheckpoint) -> SuccessMarker | None:
    """The shard's marker when `is_finished` says so, read only: the marker and one listing of
    the shard's folder, no part read and nothing written (a damaged part is the job's to repair).
    The flow's answer for every shard as a run starts, and a finished run's (driver/finished_run.py)."""
    marker = read_marker(folder, shard, checkpoint)
    if not is_finished(marker, checkpoint):
        return None
    sizes = folder.list_sizes(shard_file(shard)) if checkpoint.parts else {}
    return marker if is_finished(marker, checkpoint, sizes) else None


def finished_shard(
    folder: StorageFolder,
    shard: ShardSpec,
    *,
    rows_digest_now: Callable[[], str | None] | None,
    fence: LeaseFence | None = None,
) -> SuccessMarker | None:
    """The shard's marker when it has nothing left to do, else None; writes nothing. The flow asks
    it for every shard as the run starts (`finished_shards`) and hands its answer to Prefect's
    cache policy (tasks/run_shard.py: `shard_task`); the shard job asks `is_finished` itself,
    after its repair, on the records it folded. `fence`: the run's lease; records of a later
    lease stop it (ShardCheckpoint.load).

    The rows: the fingerprint samples the dataset (dataset_files.SAMPLE_SLICES) and can miss an
    in-place edit that keeps every size and statistic (one ground truth changed in an
    uncompressed file); each shard's first attempt recorded the exact digest of its rows
    (shard_rows.rows_digest). `rows_digest_now` gives their digest now and is asked only for a
    finished shard that recorded one (a shard recorded without a digest is not checked);
    changed rows raise FinishedRowsChanged. None skips the check: `generation.recheck_finished_rows=false`
    (bench/RESULTS.md: what it costs; docs/reliability.md, Resume: what is given up), or rows
    this run has read and checked already."""
    checkpoint = ShardCheckpoint.load(folder, shard.name, fence)
    marker = finished_marker(folder, shard.name, checkpoint)
    if marker is not None:
        check_rows_unchanged(folder, shard, checkpoint.rows_digest, rows_digest_now)
    return marker


def check_rows_unchanged(
    folder: StorageFolder, shard: ShardSpec, recorded: str | None, rows_digest_now: Callable[[], str | None] | None
) -> None:
    """FinishedRowsChanged when the shard's rows now digest otherwise than `recorded` (its first
    attempt's); nothing to check without a recorded digest or a reader (`rows_digest_reader`)."""
    if rows_digest_now is not None and recorded is not None:
        current = rows_digest_now()
        if current is not None and current != recorded:
            raise FinishedRowsChanged.of(folder, shard, current, recorded)


def rows_digest_reader(
    plan: RunPlan, shard: ShardSpec, options: dict[str, Any] | None = None
) -> Callable[[], str | None] | None:
    """`finished_shard`'s `rows_digest_now` for a shard of `plan`: its rows read again (Arrow
    only: no tokenizer, no filter) and digested; None under `generation.recheck_finished_rows=false`.
    `options`: the input files' storage options, when the caller has them."""
    if not plan.settings.recheck_finished_rows:
        return None
    options = options if options is not None else data_storage_options(plan.cfg)
    return lambda: rows_digest(read_rows(plan.dataset, shard.start, shard.end, options))


def finished_shards(
    plan: RunPlan, shards: list[ShardSpec], *, fence: LeaseFence | None = None
) -> dict[int, SuccessMarker | None]:
    """`finished_shard` for each of `shards` (by shard id), RECHECK_THREADS at a time. Every
    shard is decided before a refusal of changed rows, which names all the shards it found."""

    # Built here, not in the threads: the config is read once.
    options = data_storage_options(plan.cfg)
    readers = {shard.shard_id: rows_digest_reader(plan, shard, options) for shard in shards}

    def decide(shard: ShardSpec) -> tuple[SuccessMarker | None, FinishedRowsChanged | None]:
        try:
            return finished_shard(plan.folder, shard, rows_digest_now=readers[shard.shard_id], fence=fence), None
        except FinishedRowsChanged as changed:
            return None, changed

    with ThreadPoolExecutor(max(1, min(RECHECK_THREADS, len(shards))), thread_name_prefix="finished-shards") as pool:
        decided = list(pool.map(decide, shards))
    refused = [changed for _, changed in decided if changed is not None]
    if refused:
        first = refused[0]
        raise FinishedRowsChanged.of(
            plan.folder, first.shard, first.current, first.recorded, [other.shard.name for other in refused[1:]]
        )
    return {shard.shard_id: marker for shard, (marker, _) in zip(shards, decided, strict=True)}
