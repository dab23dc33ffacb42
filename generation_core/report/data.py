"""What a run report shows, read from a run folder without running anything.

Committed parts are streamed one at a time (orphans of crashed writes are never read) and each
is reduced to a few numbers per trajectory: response length, model tokens, reward, turns, data
source and why the response stopped (stop_reasons.py). Memory grows by about 25 bytes per
trajectory, plus one part and the viewer's sample. The viewer's sample is the `sample_size`
trajectories with the lowest hash of their sample id: uniform, the same on every report of the
run, and chosen while streaming (a bounded heap), so no second pass over the parts is needed.

Throughput over time comes from the commit records' times: each part record adds its
trajectories when it was committed (parts dropped later as damaged do not count).
"""

from __future__ import annotations

import heapq
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from generation_core.errors import GenrunError
from generation_core.outputs.ledger import ReplicaActivity, read_ledger
from generation_core.outputs.status import shard_states
from generation_core.report.stop_reasons import Limits, stop_reasons
from generation_core.store.commit_log import ShardCheckpoint, read_commit_records, read_failure_log
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import CommittedPartRef, DamagedPart, read_verified_part, repair_advice
from generation_core.store.run_folder import shard_file
from generation_core.store.run_record import RunRecord, ShardRange
from generation_core.store.trajectory_record import (
    TIMINGS,
    TrajectoryRecord,
    decode_images,
    read_part_table,
    records_of_table,
)

logger = logging.getLogger(__name__)

FAILURES_LISTED = 200
"""Failure log lines kept for the report's table (all of them are counted)."""


@dataclass
class TrajectoryStats:
    """One entry per committed trajectory, in the order the parts were read."""

    response_tokens: np.ndarray
    model_tokens: np.ndarray
    """Tokens with response_mask 1."""
    reward: np.ndarray
    """NaN where the trajectory has no reward."""
    num_turns: np.ndarray
    source: np.ndarray
    """Index into ReportData.sources."""
    stop: np.ndarray
    """Index into STOP_REASONS."""

    def __len__(self) -> int:
        return len(self.response_tokens)


@dataclass(frozen=True)
class CommitEvent:
    shard: str
    time: float
    trajectories: int
    """Trajectories the record committed (0 for an attempt's start)."""


@dataclass(frozen=True)
class FailureEntry:
    shard: str
    index: int
    rollout_n: int
    error: str
    traceback: str
    recovered: bool
    """A later attempt committed this sample."""


@dataclass
class ReportData:
    run: RunRecord
    location: str
    limits: Limits
    stats: TrajectoryStats
    sources: list[str]
    commits: list[CommitEvent]
    shards: list[dict[str, Any]]
    """shard_states rows, with parts, tokens and attempts added."""
    failures: list[FailureEntry]
    """The first FAILURES_LISTED lines of the failure logs."""
    failure_count: int
    failure_kinds: Counter
    """Failure log lines by error (its first line), over all of them."""
    sample: list[TrajectoryRecord]
    """The viewer's trajectories, in (index, rollout_n) order."""
    skipped_parts: list[str] = field(default_factory=list)
    """Committed parts that no longer match their checksum (left out, named in the report)."""
    activity: ReplicaActivity = field(default_factory=ReplicaActivity)
    """Each replica's busy spans and the time split totals, from the trajectories' provenance."""
    ledger: dict[str, Any] | None = None
    """manifest.json's capacity ledger (outputs/ledger.py), once a run has finished."""
    agent_loops: Counter = field(default_factory=Counter)
    """Trajectories by the agent loop they ran (input_fields' agent_name; None: parts that do not say)."""

    @property
    def has_rewards(self) -> bool:
        return bool(np.isfinite(self.stats.reward).any())


def sample_hash(index: np.ndarray, rollout_n: np.ndarray) -> np.ndarray:
    """A 64-bit mix (splitmix64) of each sample id: the viewer samples the lowest values."""
    with np.errstate(over="ignore"):
        x = index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + rollout_n.astype(np.uint64) * np.uint64(
            0xD1B54A32D192ED03
        )
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def records_of(table: pa.Table) -> list[TrajectoryRecord]:
    """Trajectory records of a (small) part table: the viewer's sampled rows."""
    return records_of_table(table)


def data_source_of(input_fields: dict[str, Any]) -> str:
    source = input_fields.get("data_source")
    return str(source) if source not in (None, "") else "(none)"


class _Collector:
    """Streams parts into per-trajectory arrays and the viewer's sample."""

    def __init__(self, limits: Limits, sample_size: int):
        self.limits = limits
        self.sample_size = sample_size
        self.sources: dict[str, int] = {}
        self.agent_loops: Counter[str | None] = Counter()
        self.chunks: list[tuple[np.ndarray, ...]] = []
        # Max-heap of the lowest hashes kept so far: (-hash, index, rollout_n, record).
        self.heap: list[tuple[int, int, int, TrajectoryRecord]] = []
        self.activity = ReplicaActivity()

    def add_parts(self, folder: StorageFolder, shard: str, checkpoint: ShardCheckpoint) -> list[str]:
        """Fold in the shard's committed parts; answers the paths of those that no longer match
        their checksum (left out, and named in the report)."""
        skipped = []
        for part in checkpoint.parts:
            try:
                data = read_verified_part(folder, CommittedPartRef(shard_file(shard, part.name), part.sha256))
            except DamagedPart as damaged:
                logger.warning("report: %s (left out); %s", damaged, repair_advice(folder))
                skipped.append(damaged.path)
                continue
            self.add_part(read_part_table(data))
            self.activity.time_split["storage"] += part.storage_seconds or 0.0
        return skipped

    def add_part(self, table: pa.Table) -> None:
        stop, lengths, model_tokens = stop_reasons(table, self.limits)
        reward = (
            pc.fill_null(table.column("reward_score"), float("nan")).to_numpy(zero_copy_only=False).astype(np.float64)
        )
        turns = table.column("num_turns").to_numpy(zero_copy_only=False).astype(np.int32)
        fields = [json.loads(text) for text in table.column("input_fields").to_pylist()]
        source = np.array(
            [self.sources.setdefault(data_source_of(row), len(self.sources)) for row in fields], dtype=np.int32
        )
        # The loop each row ran (the shard fills in the default for rows that name none).
        self.agent_loops.update(row.get("agent_name") for row in fields)
        self.chunks.append((lengths.astype(np.int32), model_tokens.astype(np.int32), reward, turns, source, stop))
        self._fold_provenance(table)
        self._sample(table)

    def _fold_provenance(self, table: pa.Table) -> None:
        for name in TIMINGS:
            self.activity.time_split[name] += sum(
                v for v in table.column(f"seconds_{name}").to_pylist() if v is not None
            )
        for text in table.column("provenance").to_pylist():
            if text is not None:
                self.activity.add_trajectory(json.loads(text), since=0.0)

    def _sample(self, table: pa.Table) -> None:
        if self.sample_size <= 0:
            return
        index = table.column("index").to_numpy(zero_copy_only=False)
        rollout_n = table.column("rollout_n").to_numpy(zero_copy_only=False)
        hashes = sample_hash(index, rollout_n)
        if len(self.heap) >= self.sample_size:
            rows = np.flatnonzero(hashes < np.uint64(-self.heap[0][0]))
        else:
            rows = np.arange(table.num_rows)
        # Only the part's lowest hashes can enter the sample: decode at most sample_size rows.
        rows = rows[np.argsort(hashes[rows], kind="stable")[: self.sample_size]]
        if not len(rows):
            return
        sampled = table.take(pa.array(rows))
        if sampled.column("image_digests").null_count < sampled.num_rows:
            # A row's image may be stored with a row of the part not sampled: give each its own.
            images = decode_images(table)
            cells = pa.array([images[row] for row in rows], sampled.schema.field("image_bytes").type)
            sampled = sampled.set_column(sampled.schema.get_field_index("image_bytes"), "image_bytes", cells)
        for row, record in zip(rows, records_of(sampled), strict=True):
            entry = (-int(hashes[row]), record.index, record.rollout_n, record)
            if len(self.heap) < self.sample_size:
                heapq.heappush(self.heap, entry)
            elif entry[0] > self.heap[0][0]:
                heapq.heapreplace(self.heap, entry)

    def stats(self) -> TrajectoryStats:
        columns = (
            list(zip(*self.chunks, strict=True))
            if self.chunks
            else [[np.zeros(0, dtype)] for dtype in (np.int32, np.int32, np.float64, np.int32, np.int32, np.int8)]
        )
        return TrajectoryStats(*(np.concatenate(column) for column in columns))

    def sample(self) -> list[TrajectoryRecord]:
        return sorted((entry[3] for entry in self.heap), key=lambda record: record.key)


def _commit_events(folder: StorageFolder, shard: str, live_parts: set[str]) -> list[CommitEvent]:
    _, records = read_commit_records(folder, shard)
    events = []
    for record in records:
        part = record.get("part") or {}
        if record.get("kind") == "attempt":
            events.append(CommitEvent(shard, float(record["time"]), 0))
        elif record.get("kind") == "part" and part.get("name") in live_parts:
            events.append(CommitEvent(shard, float(record["time"]), int(part["count"])))
    return events


@dataclass
class _Failures:
    """The failure logs as the report keeps them: the first FAILURES_LISTED lines, all counted."""

    listed: list[FailureEntry] = field(default_factory=list)
    count: int = 0
    kinds: Counter = field(default_factory=Counter)

    def add(self, logged: list[FailureEntry]) -> None:
        self.count += len(logged)
        self.kinds.update(entry.error.splitlines()[0] if entry.error else "(no message)" for entry in logged)
        self.listed.extend(logged[: max(FAILURES_LISTED - len(self.listed), 0)])


def _shard_row(state: dict[str, Any], spec: ShardRange, checkpoint: ShardCheckpoint) -> dict[str, Any]:
    """A shard_states row with what the report's shard table adds from the commit records."""
    return dict(
        state,
        range=[spec.start, spec.end],
        parts=len(checkpoint.parts),
        generated_tokens=checkpoint.generated_tokens,
        response_tokens=checkpoint.response_tokens,
        attempts=checkpoint.attempts,
        builds=checkpoint.builds,
    )


def _failures(folder: StorageFolder, shard: str, committed: set[str]) -> list[FailureEntry]:
    entries = []
    for failure in read_failure_log(folder, shard):
        index, rollout_n = int(failure["index"]), int(failure["rollout_n"])
        entries.append(
            FailureEntry(
                shard,
                index,
                rollout_n,
                str(failure.get("error", "")),
                str(failure.get("traceback", "")),
                f"{index}:{rollout_n}" in committed,
            )
        )
    return entries


def collect_report_data(
    folder: StorageFolder, run: RunRecord, eos_token_ids: frozenset[int], sample_size: int
) -> ReportData:
    """Everything the report shows, of the run whose run.json is `run` (read_run_record, which
    refuses a folder that is not a run). Refuses a run with nothing committed yet."""
    limits = Limits.of_run(run, eos_token_ids)
    collector = _Collector(limits, sample_size)
    states = {state["shard"]: state for state in shard_states(folder, run)}
    shards: list[dict[str, Any]] = []
    commits: list[CommitEvent] = []
    skipped: list[str] = []
    failures = _Failures()
    for spec in run.shards:
        checkpoint = ShardCheckpoint.load(folder, spec.name)
        skipped.extend(collector.add_parts(folder, spec.name, checkpoint))
        commits.extend(_commit_events(folder, spec.name, {part.name for part in checkpoint.parts}))
        failures.add(_failures(folder, spec.name, set(checkpoint.completed)))
        shards.append(_shard_row(states.get(spec.name, {"shard": spec.name}), spec, checkpoint))
    stats = collector.stats()
    if not len(stats) and skipped:
        raise GenrunError(
            f"every committed part of {folder.display()} ({len(skipped)}, e.g. {skipped[0]}) no longer matches the "
            f"checksum its checkpoint recorded: nothing to report; {repair_advice(folder)}"
        )
    if not len(stats):
        raise GenrunError(
            f"{folder.display()} has no committed trajectories yet: nothing to report "
            f"(`genrun status {folder.display()}` shows its shards)"
        )
    return ReportData(
        run=run,
        location=folder.display(),
        limits=limits,
        stats=stats,
        sources=list(collector.sources),
        commits=sorted(commits, key=lambda event: event.time),
        shards=shards,
        failures=failures.listed,
        failure_count=failures.count,
        failure_kinds=failures.kinds,
        sample=collector.sample(),
        skipped_parts=skipped,
        activity=collector.activity,
        ledger=read_ledger(folder),
        agent_loops=collector.agent_loops,
    )
