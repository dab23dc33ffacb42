"""A run's committed trajectories in (index, rollout_n) order, the order of verl's merged
DataProto, read part by part.

Each part holds its rows sorted by that key, but parts follow one another in commit order: a part
cut by age holds whatever finished in its minute, and adaptive sampling's second round commits
after the first. So the parts are merged: their key columns are read first (two columns of each
part), then a part is decoded when the merge reaches its first key and let go once its last row
is out. What is held at once is the parts whose key ranges overlap the current key: one or two
for a run of many shards, up to a shard's parts where its rows finished in a wide spread (a second
round covers the shard's whole range)."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from generation_core.errors import GenrunError
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import CommittedPartRef, committed_parts, read_verified_part
from generation_core.store.trajectory_record import TrajectoryRecord, read_part_table, records_from_parquet


def committed_parts_to_export(folder: StorageFolder) -> list[CommittedPartRef]:
    """The run's committed parts; a run that has committed none is refused (nothing to export)."""
    parts = committed_parts(folder)
    if not parts:
        raise GenrunError(
            f"{folder.display()} has no committed trajectories yet (no shard has committed a part); run genrun first"
        )
    return parts


@dataclass(frozen=True)
class PartKeys:
    """One part, the first key of its rows, and whether a row of it has images."""

    part: CommittedPartRef
    first: tuple[int, int]
    with_images: bool = False


def part_keys(folder: StorageFolder, parts: list[CommittedPartRef]) -> list[PartKeys]:
    """The parts that hold rows, by their first key (the key columns of each part, read once)."""
    keyed = []
    for part in parts:
        table = read_part_table(read_verified_part(folder, part), ["index", "rollout_n", "image_digests"])
        keys = list(zip(table.column("index").to_pylist(), table.column("rollout_n").to_pylist(), strict=True))
        if keys:
            keyed.append(PartKeys(part, min(keys), table.column("image_digests").null_count < table.num_rows))
    return sorted(keyed, key=lambda keyed_part: (keyed_part.first, keyed_part.part.path))


def records_in_key_order(
    folder: StorageFolder, parts: list[CommittedPartRef], keyed: list[PartKeys] | None = None
) -> Iterator[tuple[TrajectoryRecord, CommittedPartRef]]:
    """Every committed record with its part, in (index, rollout_n) order (see the module docstring);
    `keyed`: `part_keys` of the parts, where the caller has read them already."""
    pending = part_keys(folder, parts) if keyed is None else keyed
    heap: list[tuple[tuple[int, int], int, int, list[TrajectoryRecord], CommittedPartRef]] = []
    opened = 0
    while opened < len(pending) or heap:
        # Open every part whose first key comes before the smallest key held.
        while opened < len(pending) and (not heap or pending[opened].first <= heap[0][0]):
            part = pending[opened].part
            records = sorted(records_from_parquet(read_verified_part(folder, part)), key=lambda record: record.key)
            heapq.heappush(heap, (records[0].key, opened, 0, records, part))
            opened += 1
        key, number, position, records, part = heapq.heappop(heap)
        yield records[position], part
        if position + 1 < len(records):
            heapq.heappush(heap, (records[position + 1].key, number, position + 1, records, part))
