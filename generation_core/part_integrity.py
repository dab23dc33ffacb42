"""Damaged parts: found by their checkpoint's size and sha256, dropped, their samples regenerated.

A part can be damaged after it was committed (a truncated copy, a bad disk, someone editing the
bucket). Every shard attempt verifies the parts its checkpoint lists before it resumes; the
driver compares sizes from one listing per shard before it decides a finished shard needs no
work; the merge re-checks every sha256 as it reads. A damaged part is dropped from the
checkpoint, which makes its samples pending again, and recorded under `repaired_parts` (the
checkpoint and the shard's marker) with the reason, so it is reported, never silently lost. The
damaged file itself stays where it is, listed by no checkpoint (like the orphan of a crash).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from generation_core.errors import GenrunError
from generation_core.shard import CHECKPOINT, SUCCESS
from generation_core.storage import RunFolder

logger = logging.getLogger(__name__)


class DamagedPart(GenrunError):
    """A committed part no longer matches what its checkpoint recorded."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def part_damage(folder: RunFolder, shard_name: str, part: dict[str, Any], *, size_only: bool = False, sizes: dict[str, int] | None = None) -> str | None:
    """Why a committed part is damaged, or None when it is intact."""
    path = f"shards/{shard_name}/{part['name']}"
    if sizes is not None:
        size = sizes.get(part["name"])
        if size is None:
            return "missing"
        if size != part["bytes"]:
            return f"size {size} bytes, checkpoint recorded {part['bytes']}"
        if size_only:
            return None
    try:
        data = folder.read_bytes(path)
    except FileNotFoundError:
        return "missing"
    if len(data) != part["bytes"]:
        return f"size {len(data)} bytes, checkpoint recorded {part['bytes']}"
    if hashlib.sha256(data).hexdigest() != part["sha256"]:
        return "sha256 does not match the checkpoint"
    return None


def damaged_parts(folder: RunFolder, shard_name: str, parts: list[dict[str, Any]], *, size_only: bool = False) -> dict[str, str]:
    """{part name: reason} for every damaged part of a shard. `size_only`: one listing, no reads
    (catches missing and truncated parts; a same-size corruption needs the full check)."""
    sizes = folder.list_sizes(f"shards/{shard_name}") if size_only else None
    reasons = {}
    for part in parts:
        reason = part_damage(folder, shard_name, part, size_only=size_only, sizes=sizes)
        if reason:
            reasons[part["name"]] = reason
    return reasons


def drop_damaged_parts(folder: RunFolder, shard_name: str, checkpoint: dict[str, Any], reasons: dict[str, str]) -> dict[str, Any]:
    """The checkpoint without the damaged parts and their samples (pending again), with the
    repairs recorded; written back, and the shard's success marker removed."""
    kept, completed, repaired = [], [], list(checkpoint.get("repaired_parts", []))
    # `completed` lists samples in commit order, part by part (see shard._PartWriter).
    if sum(p["count"] for p in checkpoint["parts"]) != len(checkpoint["completed"]):
        raise GenrunError(
            f"cannot repair shards/{shard_name}: its checkpoint's part counts do not add up to its completed samples; "
            f"delete {folder.display(f'shards/{shard_name}')} to regenerate the whole shard"
        )
    offset = 0
    for part in checkpoint["parts"]:
        samples = checkpoint["completed"][offset : offset + part["count"]]
        offset += part["count"]
        if part["name"] in reasons:
            repaired.append({"name": part["name"], "reason": reasons[part["name"]], "samples": len(samples), "time": round(time.time(), 3)})
            logger.warning(
                "shards/%s/%s is damaged (%s): dropped from the checkpoint, its %d samples will be regenerated",
                shard_name, part["name"], reasons[part["name"]], len(samples),
            )
        else:
            kept.append(part)
            completed.extend(samples)
    repaired_checkpoint = dict(checkpoint, parts=kept, completed=completed, repaired_parts=repaired)
    # Token totals from the parts that remain (parts written before they carried their own
    # counts keep the old totals less nothing: an undercount is better than a wrong sum).
    if all("response_tokens" in p for p in kept):
        repaired_checkpoint["response_tokens"] = sum(p["response_tokens"] for p in kept)
        repaired_checkpoint["generated_tokens"] = sum(p["generated_tokens"] for p in kept)
    # Marker first: a crash between the two leaves an unfinished shard whose next attempt
    # finds the same damage again.
    folder.remove(f"shards/{shard_name}/{SUCCESS}")
    folder.put_json(f"shards/{shard_name}/{CHECKPOINT}", repaired_checkpoint)
    return repaired_checkpoint


def repair_shard(folder: RunFolder, shard_name: str, *, size_only: bool = False) -> int:
    """Verify a shard's committed parts and drop the damaged ones; returns how many were dropped."""
    path = f"shards/{shard_name}/{CHECKPOINT}"
    if not folder.exists(path):
        return 0
    checkpoint = folder.read_json(path)
    reasons = damaged_parts(folder, shard_name, checkpoint["parts"], size_only=size_only)
    if reasons:
        drop_damaged_parts(folder, shard_name, checkpoint, reasons)
    return len(reasons)


def mark_for_repair(folder: RunFolder, damaged: DamagedPart) -> None:
    """After the merge found `damaged`: drop it so the next run regenerates its samples."""
    _, shard_name, part_name = damaged.path.split("/", 2)
    checkpoint = folder.read_json(f"shards/{shard_name}/{CHECKPOINT}")
    drop_damaged_parts(folder, shard_name, checkpoint, {part_name: "sha256 does not match the checkpoint (found by the merge)"})
