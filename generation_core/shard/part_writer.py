"""Commit finished trajectories of one shard: an immutable part streamed out, then the commit
record that lists it.

Exactly-once on local disk and S3 alike: a part is written whole under a fresh name
(`StorageFolder.open_write`: a temporary file renamed at the end on local disk, a multipart upload
completed at the end on S3), then its commit record is created under the next free number
(commit_log.py). A crash between the two leaves an orphan part that no record lists and nobody
reads. The failure log follows the record that counts its samples, in a file named by that
record's number (a crash in between loses only the error text of samples that are pending again
anyway); errors and tracebacks are capped at FAILURE_TEXT_CHARS.

Parts are few and large. Records stream into the open part as row groups (a few MiB or
ROW_GROUP_RECORDS records each, `trajectory_record.part_parquet_writer`), counted and sha256-hashed as
the bytes go out, so a shard worker holds at most one row group of records, never a whole part.
A part is committed when its bytes reach `generation.part_target_bytes`, when its first record
is `generation.part_max_seconds` old (what a crash can lose), when it holds
`generation.save_batch_size` trajectories (an optional cap), or when the stream ends.

Fencing. Under a run lease, checking the lease and then writing leaves a window: a run whose
heartbeat stalled may pass the check, stall again, and write after another run took the folder
over and started on the shard. The commit record closes it: it is created exclusively under the
number after the last record this writer knows, and a run that takes over claims the shard by
creating that number first (its attempt record, `ShardCheckpoint.start_attempt`). A late commit
of the old holder finds the number taken, re-checks the lease and raises LeaseLost; it removes
the part it had just written and leaves the folder as it was. A commit that lands before the
claim has the lower number and is read by the new holder like any other.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
import time
from contextlib import ExitStack

from generation_core.config.settings import GenerationSettings
from generation_core.instrumentation import failpoint, mark
from generation_core.store.commit_log import CheckpointConflict, ShardCheckpoint, write_failure_log
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseFence, LeaseLost
from generation_core.store.run_folder import FAILURES_DIR, PartActivity, PartEntry, new_part_name, shard_file
from generation_core.store.trajectory_record import (
    SampleFailure,
    TrajectoryRecord,
    part_parquet_writer,
    records_to_table,
    sample_key_text,
    to_json,
)

logger = logging.getLogger(__name__)

# A row group is written once this many records, or about ROW_GROUP_BYTES of their tokens, are
# waiting: what a shard worker holds as Python objects is bounded by one row group.
ROW_GROUP_RECORDS = 512
ROW_GROUP_BYTES = 4 << 20
# The longest error text and traceback a failure log line keeps.
FAILURE_TEXT_CHARS = 2000


def _raw_bytes(record: TrajectoryRecord) -> int:
    """About what a record's tokens take in Arrow (int32 ids, int8 mask, float32 logprobs)."""
    per_response_token = 9 if record.response_logprobs is not None else 5
    return 4 * len(record.prompt_ids) + per_response_token * len(record.response_ids) + 256


class _HashingSink:
    """The file object the Parquet writer writes to: counts and hashes every byte on its way to
    the part's storage writer. Closing it is the caller's business (publishing the part)."""

    def __init__(self, target):
        self.target = target
        self.bytes = 0
        self.sha256 = hashlib.sha256()
        self.closed = False
        self.discarded = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if not self.discarded:
            self.sha256.update(view)
            self.target.write(view)
        self.bytes += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        pass  # the storage writer uploads or syncs when the part is published

    def close(self) -> None:
        self.closed = True


class _OpenPart:
    """A part being written: its name, storage writer, hashing sink and Parquet writer."""

    def __init__(self, folder: StorageFolder, shard: str, name: str):
        self.name = name
        # The storage writer's `with` block spans the part's life: it ends in `publish` (the part
        # appears) or in `discard` (nothing does).
        self.block = ExitStack()
        self.sink = _HashingSink(self.block.enter_context(folder.open_write(shard_file(shard, name))))
        try:
            self.parquet = part_parquet_writer(self.sink)  # writes the leading magic bytes
        except BaseException as exc:
            self.block.__exit__(type(exc), exc, None)
            raise

    def publish(self) -> tuple[int, str]:
        """Write the footer and make the part appear under its name; (bytes, sha256)."""
        try:
            self.parquet.close()
        except BaseException:
            self.discard()
            raise
        self.block.close()  # on failure the storage writer removes or aborts what it wrote
        return self.sink.bytes, self.sink.sha256.hexdigest()

    def discard(self) -> None:
        """Leave nothing: the temporary file is removed, the multipart upload aborted."""
        self.sink.discarded = True
        try:
            self.parquet.close()
        except Exception as exc:  # noqa: BLE001 - a writer that failed half way: the part goes either way
            logger.debug("closing the discarded part %s: %s", self.name, exc)
        discarded = RuntimeError(f"part {self.name} discarded")
        self.block.__exit__(RuntimeError, discarded, None)


class PartWriter:
    """Streams a shard's finished records into its open part and collects failures; `commit`
    publishes the part, creates its commit record, then appends the failure log. With a `fence`
    (the run's lease), every write is fenced: `checkpoint` must come from
    `ShardCheckpoint.start_attempt(..., fence)`, which claimed the shard.

    `add` and `add_failure` only buffer; `write_row_group` and `commit` do the I/O (the job
    runs them in a thread when `row_group_ready` or `should_commit` says so)."""

    def __init__(
        self,
        folder: StorageFolder,
        shard: str,
        shard_id: int,
        checkpoint: ShardCheckpoint,
        fence: LeaseFence | None = None,
        *,
        target_bytes: int = GenerationSettings.part_target_bytes,
        max_seconds: float = GenerationSettings.part_max_seconds,
        max_records: int | None = None,
        first_part_max_seconds: float | None = None,
    ):
        self.folder, self.shard, self.shard_id, self.checkpoint, self.fence = folder, shard, shard_id, checkpoint, fence
        self.target_bytes, self.max_seconds, self.max_records = target_bytes, max_seconds, max_records
        # The attempt's first part is cut young: a run shows committed output (and that its
        # storage works) within seconds of its first trajectory, not a minute later.
        self.first_part_max_seconds = (
            max_seconds if first_part_max_seconds is None else min(first_part_max_seconds, max_seconds)
        )
        self.parts_committed = 0
        self.pending: list[TrajectoryRecord] = []
        """Records not yet written as a row group (at most one row group's worth)."""
        self.pending_bytes = 0
        self.part: _OpenPart | None = None
        self.part_keys: list[str] = []
        """Sample keys of the uncommitted part, written or pending."""
        self.part_response_tokens = 0
        self.part_generated_tokens = 0
        self.part_storage_seconds = 0.0
        """Serialization and storage time of the open part (its entry's `storage_seconds`)."""
        self.part_activity = PartActivity()
        """The capacity ledger's counters of the open part (its entry's `activity`)."""
        self.new_failures: list[SampleFailure] = []
        self.first_buffered_at: float | None = None
        self.stage_seconds = {"serialization": 0.0, "storage": 0.0}
        # Held by each write and by `discard`: a discard (the attempt ends, perhaps cancelled
        # while a commit runs in a thread) waits for the commit in flight instead of emptying
        # the sample list it is recording.
        self._writing = threading.RLock()

    def add(self, record: TrajectoryRecord) -> None:
        if not self.has_uncommitted():
            self.first_buffered_at = time.monotonic()
        self.pending.append(record)
        self.pending_bytes += _raw_bytes(record)
        self.part_keys.append(sample_key_text(record.key))
        # Per part, so dropping a damaged part keeps the shard's totals right.
        self.part_response_tokens += len(record.response_ids)
        self.part_generated_tokens += sum(record.response_mask)
        self.part_activity.add(record.provenance, record.timings)

    def add_failure(self, failure: SampleFailure) -> None:
        if not self.has_uncommitted():
            self.first_buffered_at = time.monotonic()
        self.new_failures.append(failure)

    def failures_this_attempt(self) -> int:
        # The checkpoint's failed list starts empty each attempt and grows at every commit.
        return len(self.checkpoint.failed) + len(self.new_failures)

    def has_uncommitted(self) -> bool:
        return bool(self.part_keys or self.new_failures)

    def age(self) -> float:
        return 0.0 if self.first_buffered_at is None else time.monotonic() - self.first_buffered_at

    def part_bytes(self) -> int:
        """Bytes of the open part written so far (its row groups; the footer comes at commit)."""
        return self.part.sink.bytes if self.part is not None else 0

    def row_group_ready(self) -> bool:
        return len(self.pending) >= ROW_GROUP_RECORDS or self.pending_bytes >= min(ROW_GROUP_BYTES, self.target_bytes)

    def should_commit(self) -> bool:
        if not self.has_uncommitted():
            return False
        if self.max_records is not None and len(self.part_keys) >= self.max_records:
            return True
        return self.part_bytes() >= self.target_bytes or self.age() >= self.current_max_seconds

    @property
    def current_max_seconds(self) -> float:
        """The open part's age limit (the first part's is shorter)."""
        return self.first_part_max_seconds if self.parts_committed == 0 else self.max_seconds

    def write_row_group(self) -> None:
        """Write the pending records into the open part (opening it first). On a storage error
        the uncommitted part is discarded (the attempt ends; its samples are pending again)."""
        with self._writing:
            self._write_row_group()

    def _write_row_group(self) -> None:
        if not self.pending:
            return
        began = time.perf_counter()
        try:
            if self.part is None:
                failpoint("before_part_write")
                started = time.perf_counter()
                self.part = _OpenPart(self.folder, self.shard, new_part_name(len(self.checkpoint.parts)))
                self.stage_seconds["storage"] += time.perf_counter() - started
            started = time.perf_counter()
            table = records_to_table(self.pending)
            self.pending, self.pending_bytes = [], 0
            serialized = time.perf_counter()
            self.stage_seconds["serialization"] += serialized - started
            self.part.parquet.write_table(table)
            self.stage_seconds["storage"] += time.perf_counter() - serialized
            self.part_storage_seconds += time.perf_counter() - began
        except OSError as exc:
            self.discard()
            raise self._explained(exc) from exc

    def _explained(self, exc: OSError) -> OSError:
        # A full disk fails a streamed part as StorageFolder fails every other write: the folder
        # named, and what to do.
        if self.folder.is_local and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return self.folder._full_disk(exc, shard_file(self.shard, "batch-*.parquet"))
        return exc

    def discard(self) -> None:
        """Drop what is not committed (the attempt ends in an error): the open part leaves no
        file and no upload behind; its samples and the uncommitted failures are pending again."""
        with self._writing:
            self._discard()

    def _discard(self) -> None:
        part, self.part = self.part, None
        self.pending, self.pending_bytes = [], 0
        self.part_keys, self.new_failures = [], []
        self.part_response_tokens = self.part_generated_tokens = 0
        self.part_storage_seconds = 0.0
        self.part_activity = PartActivity()
        self.first_buffered_at = None
        if part is not None:
            part.discard()

    def commit(self) -> None:
        with self._writing:
            self._commit()

    def _commit(self) -> None:
        if not self.has_uncommitted():
            return
        if self.fence is not None:
            # Refuses early; the exclusive commit record below is what closes the window.
            self.fence.check(self.folder)
        entry = self._publish_part() if self.part_keys else None
        if entry is not None:
            if not self.checkpoint.parts:
                mark(f"first_part_written {self.shard_id}")
            mark(f"part_written {self.shard_id}")
            # The window a crash must not lose or duplicate anything in: part written, not listed.
            failpoint("after_part_write")
        failure_lines = self._failure_lines()
        started = time.perf_counter()
        try:
            self.checkpoint.commit_part(
                self.folder,
                self.shard,
                entry,
                self.part_keys,
                [sample_key_text(f.key) for f in self.new_failures],
                self.fence,
            )
        except (LeaseLost, CheckpointConflict):
            # Refused: the part is ours alone (a fresh name no record lists); leave nothing.
            if entry is not None:
                self.folder.remove(shard_file(self.shard, entry.name))
            raise
        self.stage_seconds["storage"] += time.perf_counter() - started
        if entry is not None:
            logger.info(
                "%s: committed %s (%d trajectories, %d bytes, %d in shard)",
                self.shard,
                entry.name,
                entry.count,
                entry.bytes,
                len(self.checkpoint.completed),
            )
        if failure_lines:
            # Named by the record that counts these failures: written once, never rewritten.
            write_failure_log(self.folder, self.shard, self.checkpoint.next_seq - 1, failure_lines, self.fence)
            logger.warning(
                "%s: %d sample(s) failed, recorded in %s",
                self.shard,
                len(self.new_failures),
                self.folder.display(shard_file(self.shard, FAILURES_DIR)),
            )
        self.part_keys = []
        self.part_response_tokens = self.part_generated_tokens = 0
        self.part_storage_seconds = 0.0
        self.part_activity = PartActivity()
        self.new_failures = []
        self.first_buffered_at = None
        self.parts_committed += 1

    def _publish_part(self) -> PartEntry:
        """Write what is pending, close the part and make it appear; its entry."""
        self.write_row_group()
        part, self.part = self.part, None
        assert part is not None, "records are pending (part_keys): write_row_group opened the part"
        started = time.perf_counter()
        try:
            size, sha256 = part.publish()
        except OSError as exc:
            raise self._explained(exc) from exc
        self.stage_seconds["storage"] += time.perf_counter() - started
        self.part_storage_seconds += time.perf_counter() - started
        return PartEntry(
            name=part.name,
            count=len(self.part_keys),
            bytes=size,
            sha256=sha256,
            response_tokens=self.part_response_tokens,
            generated_tokens=self.part_generated_tokens,
            storage_seconds=round(self.part_storage_seconds, 6),
            activity=self.part_activity.to_dict(),
        )

    def _failure_lines(self) -> str:
        """The failure log's lines for the buffered failures, counted in the commit record."""
        now = time.time()
        lines = [
            to_json(
                {
                    "sample": sample_key_text(f.key),
                    "index": f.index,
                    "rollout_n": f.rollout_n,
                    "error": _capped(f.error, keep="head"),
                    "traceback": _capped(f.traceback, keep="tail"),
                    "attempt": self.checkpoint.attempts,
                    "time": round(now, 3),
                }
            )
            for f in self.new_failures
        ]
        return "".join(line + "\n" for line in lines)


def _capped(text: str | None, *, keep: str) -> str | None:
    """At most FAILURE_TEXT_CHARS of an error or traceback: a huge message (a model's whole
    output in an exception) costs its shard's log once, bounded. A traceback keeps its end,
    where the raising frame and the error are."""
    if text is None or len(text) <= FAILURE_TEXT_CHARS:
        return text
    cut = len(text) - FAILURE_TEXT_CHARS
    return (
        f"{text[:FAILURE_TEXT_CHARS]}... [{cut} more characters]"
        if keep == "head"
        else f"[{cut} characters before] ...{text[-FAILURE_TEXT_CHARS:]}"
    )
