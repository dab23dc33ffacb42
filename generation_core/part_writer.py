"""Commit finished trajectories of one shard: an immutable part, then the checkpoint that lists it.

Exactly-once on local disk and S3 alike: a part is written whole under a fresh name, then the
checkpoint that lists it replaces the old one in one atomic put. A crash between the two leaves
an orphan part that no checkpoint lists and nobody reads. The failure log follows the
checkpoint that counts its samples (a crash in between loses only the error text of samples
that are pending again anyway).

Fencing. Under a run lease, checking the lease and then writing leaves a window: a run whose
heartbeat stalled may pass the check, stall again, and write after another run took the folder
over and started on the shard, clobbering its checkpoint. So the checkpoint write itself is
conditional, and takeover invalidates the condition:
- a run claims a shard's checkpoint before generating into it (`ShardCheckpoint.load` with the
  fence): the checkpoint is rewritten under the run's lease generation, a conditional write
  like every other;
- every commit writes the checkpoint only over the version this writer last read or wrote:
  `If-Match: <ETag>` on S3 (`If-None-Match: *` for the first), a compare-and-rename under an
  exclusive lock of the shard's directory on local disk (storage.RunFolder.put_if_version).
A late commit of the old holder therefore finds the checkpoint changed once the new holder has
claimed the shard; it raises LeaseLost, removes the part it had just written and leaves the
folder as it was. A commit that lands before the claim is read by the new holder like any other.
We chose ETag conditions on the one checkpoint object over numbered commit objects created
exclusively because readers (merge, status, tests) keep reading one `checkpoint.json`; the claim
is the same step an append-only log of numbered commits (issue 16) would take by creating the
next number for its lease.
"""

from __future__ import annotations

import hashlib
import logging
import time

from generation_core.instrumentation import failpoint, mark
from generation_core.lease import LeaseFence, LeaseLost
from generation_core.records import SampleFailure, TrajectoryRecord, records_to_parquet, sample_key_text, to_json
from generation_core.run_folder import CheckpointConflict, PartEntry, ShardCheckpoint, append_failure_log, new_part_name, shard_file
from generation_core.storage import RunFolder

logger = logging.getLogger(__name__)


class PartWriter:
    """Buffers a shard's finished records and failures; `commit` writes them as one part, the
    checkpoint, then the failure log. With a `fence` (the run's lease), every write is fenced:
    `checkpoint` must come from `ShardCheckpoint.load(..., fence)`, which claimed the shard."""

    def __init__(self, folder: RunFolder, shard: str, shard_id: int, checkpoint: ShardCheckpoint, fence: LeaseFence | None = None):
        self.folder, self.shard, self.shard_id, self.checkpoint, self.fence = folder, shard, shard_id, checkpoint, fence
        self.buffer: list[TrajectoryRecord] = []
        self.new_failures: list[SampleFailure] = []
        self.first_buffered_at: float | None = None
        self.stage_seconds = {"serialization": 0.0, "storage": 0.0}

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
            # Refuses early; the conditional checkpoint write below is what closes the window.
            self.fence.check(self.folder)
        part = None
        if self.buffer:
            part = self._write_part()
            if len(self.checkpoint.parts) == 1:
                mark(f"first_part_written {self.shard_id}")
            mark(f"part_written {self.shard_id}")
            # The window a crash must not lose or duplicate anything in: part written, not listed.
            failpoint("after_part_write")
        failure_lines = self._failure_lines()
        started = time.perf_counter()
        try:
            self.checkpoint.save(self.folder, self.shard, self.fence)
        except (LeaseLost, CheckpointConflict):
            # Refused: the part is ours alone (a fresh name no checkpoint lists); leave nothing.
            if part is not None:
                self.folder.remove(shard_file(self.shard, part))
            raise
        self.stage_seconds["storage"] += time.perf_counter() - started
        if failure_lines:
            append_failure_log(self.folder, self.shard, failure_lines, self.fence)
            logger.warning("%s: %d sample(s) failed, recorded in %s", self.shard, len(self.new_failures), self.folder.display(shard_file(self.shard)))
        self.buffer = []
        self.new_failures = []
        self.first_buffered_at = None

    def _failure_lines(self) -> str:
        """The failure log's lines for the buffered failures, counted in the checkpoint."""
        now = time.time()
        lines = [
            to_json({"sample": sample_key_text(f.key), "index": f.index, "rollout_n": f.rollout_n, "error": f.error, "traceback": f.traceback, "attempt": self.checkpoint.attempts, "time": round(now, 3)})
            for f in self.new_failures
        ]
        self.checkpoint.failed.extend(sample_key_text(f.key) for f in self.new_failures)
        return "".join(line + "\n" for line in lines)

    def _write_part(self) -> str:
        """Writes the buffer as a part and adds it to the checkpoint (in memory); its name."""
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
        return name
