"""Commit finished trajectories of one shard: an immutable part, then the checkpoint that lists it.

Exactly-once on local disk and S3 alike: a part is written whole under a fresh name, then the
checkpoint that lists it replaces the old one in one atomic put. A crash between the two leaves
an orphan part that no checkpoint lists and nobody reads.
"""

from __future__ import annotations

import hashlib
import logging
import time

from generation_core.instrumentation import failpoint, mark
from generation_core.lease import LeaseFence
from generation_core.records import SampleFailure, TrajectoryRecord, records_to_parquet, sample_key_text, to_json
from generation_core.run_folder import PartEntry, ShardCheckpoint, new_part_name, read_failure_log, shard_file, write_failure_log
from generation_core.storage import RunFolder

logger = logging.getLogger(__name__)


class PartWriter:
    """Buffers a shard's finished records and failures; `commit` writes them as one part (and
    the failure log) followed by the checkpoint. With a `fence` (the run's lease), every commit
    first checks that no later run took the folder."""

    def __init__(self, folder: RunFolder, shard: str, shard_id: int, checkpoint: ShardCheckpoint, fence: LeaseFence | None = None):
        self.folder, self.shard, self.shard_id, self.checkpoint, self.fence = folder, shard, shard_id, checkpoint, fence
        self.buffer: list[TrajectoryRecord] = []
        self.new_failures: list[SampleFailure] = []
        self.first_buffered_at: float | None = None
        self.stage_seconds = {"serialization": 0.0, "storage": 0.0}
        self.failure_log = read_failure_log(folder, shard)

    def add(self, record: TrajectoryRecord) -> None:
        if not self.has_uncommitted():
            self.first_buffered_at = time.monotonic()
        self.buffer.append(record)

    def add_failure(self, failure: SampleFailure) -> None:
        if not self.has_uncommitted():
            self.first_buffered_at = time.monotonic()
        self.new_failures.append(failure)

    def failures_this_attempt(self) -> int:
        # The checkpoint's failed list starts empty each attempt and grows at every commit.
        return len(self.checkpoint.failed) + len(self.new_failures)

    def has_uncommitted(self) -> bool:
        return bool(self.buffer or self.new_failures)

    def age(self) -> float:
        return 0.0 if self.first_buffered_at is None else time.monotonic() - self.first_buffered_at

    def commit(self) -> None:
        if not self.has_uncommitted():
            return
        if self.fence is not None:
            self.fence.check(self.folder)
        if self.new_failures:
            # Before the checkpoint that counts them: a crash in between only leaves log lines
            # for samples that are pending anyway.
            self._write_failures()
        if self.buffer:
            self._write_part()
            if len(self.checkpoint.parts) == 1:
                mark(f"first_part_written {self.shard_id}")
            mark(f"part_written {self.shard_id}")
            # The window a crash must not lose or duplicate anything in: part written, not listed.
            failpoint("after_part_write")
        started = time.perf_counter()
        self.checkpoint.save(self.folder, self.shard)
        self.stage_seconds["storage"] += time.perf_counter() - started
        self.buffer = []
        self.new_failures = []
        self.first_buffered_at = None

    def _write_failures(self) -> None:
        now = time.time()
        lines = [
            to_json({"sample": sample_key_text(f.key), "index": f.index, "rollout_n": f.rollout_n, "error": f.error, "attempt": self.checkpoint.attempts, "time": round(now, 3)})
            for f in self.new_failures
        ]
        self.failure_log += "".join(line + "\n" for line in lines)
        write_failure_log(self.folder, self.shard, self.failure_log)
        self.checkpoint.failed.extend(sample_key_text(f.key) for f in self.new_failures)
        logger.warning("%s: %d sample(s) failed, recorded in %s", self.shard, len(self.new_failures), self.folder.display(shard_file(self.shard)))

    def _write_part(self) -> None:
        started = time.perf_counter()
        data = records_to_parquet(self.buffer)
        serialized = time.perf_counter()
        self.stage_seconds["serialization"] += serialized - started
        name = new_part_name(len(self.checkpoint.parts))
        failpoint("before_part_write")
        self.folder.put_atomic(shard_file(self.shard, name), data)
        self.stage_seconds["storage"] += time.perf_counter() - serialized
        part = PartEntry(
            name=name,
            count=len(self.buffer),
            bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            # Per part, so dropping a damaged part keeps the shard's totals right.
            response_tokens=sum(len(r.response_ids) for r in self.buffer),
            generated_tokens=sum(sum(r.response_mask) for r in self.buffer),
        )
        self.checkpoint.parts.append(part)
        self.checkpoint.completed.extend(sample_key_text(r.key) for r in self.buffer)
        self.checkpoint.response_tokens += part.response_tokens
        self.checkpoint.generated_tokens += part.generated_tokens
        logger.info("%s: committed %s (%d trajectories, %d in shard)", self.shard, name, part.count, len(self.checkpoint.completed))
