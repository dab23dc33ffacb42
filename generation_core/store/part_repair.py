"""Committed parts checked against their commit records (size and sha256), and the repair of a
shard whose part is damaged: the part is dropped with a `repair` record, its samples pending
again, so a loss is reported and regenerated, never silent; the damaged file stays where it is,
listed by no live record."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from generation_core.errors import GenrunError
from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.fencing import Fence
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import SHARDS_DIR, SUCCESS_FILE, PartEntry, shard_file

logger = logging.getLogger(__name__)


class DamagedPart(GenrunError):
    """A committed part no longer matches what its checkpoint recorded."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class CommittedPartRef:
    path: str
    sha256: str
    storage_seconds_per_row: float | None = None
    """Its rows' share of the time spent writing it (PartEntry.storage_seconds); None for
    parts of earlier versions."""


def committed_parts(folder: StorageFolder) -> list[CommittedPartRef]:
    """Every part a shard checkpoint lists (orphans of crashed writes are not), shard by shard."""
    parts: list[CommittedPartRef] = []
    for shard in folder.list(SHARDS_DIR):
        checkpoint = ShardCheckpoint.load(folder, shard)
        parts.extend(
            CommittedPartRef(shard_file(shard, p.name), p.sha256, _per_row(p.storage_seconds, p.count))
            for p in checkpoint.parts
        )
    return parts


def _per_row(seconds: float | None, rows: int) -> float | None:
    return None if seconds is None or not rows else round(seconds / rows, 6)


def read_verified_part(folder: StorageFolder, part: CommittedPartRef) -> bytes:
    try:
        data = folder.read_bytes(part.path)
    except FileNotFoundError:
        raise DamagedPart(
            f"part {folder.display(part.path)}, listed by its shard's checkpoint, is missing", part.path
        ) from None
    if hashlib.sha256(data).hexdigest() != part.sha256:
        raise DamagedPart(
            f"part {folder.display(part.path)} does not match the checksum its checkpoint recorded", part.path
        )
    return data


def size_damage(part: PartEntry, sizes: Mapping[str, int]) -> str | None:
    """Why a committed part is damaged, from one listing of its shard's folder (`sizes`: file name
    -> bytes): missing, or of another size than its record says; None when it is there at its
    recorded size (a same-size corruption needs `part_damage`). No part is read."""
    size = sizes.get(part.name)
    if size is None:
        return "missing"
    return f"size {size} bytes, checkpoint recorded {part.bytes}" if size != part.bytes else None


def part_damage(folder: StorageFolder, shard: str, part: PartEntry) -> str | None:
    """Why a committed part is damaged, read whole and checked against its record (size and
    sha256), or None when it is intact."""
    try:
        data = folder.read_bytes(shard_file(shard, part.name))
    except FileNotFoundError:
        return "missing"
    if len(data) != part.bytes:
        return f"size {len(data)} bytes, checkpoint recorded {part.bytes}"
    if hashlib.sha256(data).hexdigest() != part.sha256:
        return "sha256 does not match the checkpoint"
    return None


def drop_damaged_parts(
    folder: StorageFolder, shard: str, checkpoint: ShardCheckpoint, reasons: dict[str, str], fence: Fence | None = None
) -> ShardCheckpoint:
    """Drop the damaged parts (their samples are pending again) with a `repair` record, after
    removing the shard's success marker; returns `checkpoint`, updated. With `fence`, only
    while the run holds the folder, as the next record after those `checkpoint` was read from."""
    now = round(time.time(), 3)
    repaired = []
    for part in checkpoint.parts:
        if part.name in reasons:
            samples = len(checkpoint.part_samples.get(part.name, []))
            repaired.append({"name": part.name, "reason": reasons[part.name], "samples": samples, "time": now})
            logger.warning(
                "%s is damaged (%s): dropped from the checkpoint, its %d samples will be regenerated",
                shard_file(shard, part.name),
                reasons[part.name],
                samples,
            )
    # Marker first: a crash between the two leaves an unfinished shard whose next attempt
    # finds the same damage again. A run that lost its lease stops before either.
    if fence is not None:
        fence.check(folder)
    folder.remove(shard_file(shard, SUCCESS_FILE))
    if repaired:
        checkpoint.commit_repair(folder, shard, repaired, fence)
    return checkpoint


def repair_damaged_parts(
    folder: StorageFolder, shard: str, checkpoint: ShardCheckpoint, fence: Fence | None = None
) -> list[dict[str, Any]]:
    """The shard job's first step: read every part `checkpoint` (the shard's records as the job
    folded them) lists, check it against its record, and drop the damaged ones
    (`drop_damaged_parts`, which logs each); returns what was repaired (`checkpoint` is updated
    with the repair record). `fence`: the run's lease; a run that lost it repairs nothing."""
    reasons = {part.name: reason for part in checkpoint.parts if (reason := part_damage(folder, shard, part))}
    if not reasons:
        return []
    before = len(checkpoint.repaired_parts)
    drop_damaged_parts(folder, shard, checkpoint, reasons, fence)
    return checkpoint.repaired_parts[before:]


def repair_advice(folder: StorageFolder) -> str:
    """What a reader that found a damaged part (export, report) tells the user: the merge drops it
    from its shard's checkpoint (mark_for_repair), then the run's own command regenerates it."""
    return f"run `genrun merge {folder.display()}` (it drops the damaged part), then the same command to regenerate its samples"


def mark_for_repair(folder: StorageFolder, damaged: DamagedPart, fence: Fence | None = None) -> None:
    """After the merge found `damaged`: drop it so the next run regenerates its samples."""
    _, shard, part_name = damaged.path.split("/", 2)
    checkpoint = ShardCheckpoint.load(folder, shard)
    drop_damaged_parts(
        folder, shard, checkpoint, {part_name: "sha256 does not match the checkpoint (found by the merge)"}, fence
    )
