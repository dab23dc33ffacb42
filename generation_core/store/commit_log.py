"""The commit log of a shard: its numbered commit records, their fold into one view
(`ShardCheckpoint`), the fence on every record, the `done` record and the success marker that
names it. run_folder.py names the files; this module decides what they mean; part_repair.py
checks committed parts against their records; fencing.py fences the finishing steps' writes.

Commit records. A shard's progress is an append-only sequence `commits/<seq:010d>.json`, each
record created under a name that must be free (`StorageFolder.create_exclusive`: a hard link on
local disk, `If-None-Match: *` on S3), so neither append nor rename is needed. Kinds:
- `attempt`: an attempt starts (`attempt` number, `lease`, optional `rows_digest`, the genrun
  `build` that runs it); the failed list starts empty again;
- `part`: one part (`part`: its PartEntry with size, sha256, token counts and the capacity
  ledger's counters of its trajectories (`PartActivity`); `samples`: its own
  sample keys as runs `[rollout_n, first_index, last_index]`; `failed`: sample keys that failed
  since the previous commit, kept across attempts for adaptive sampling; `part` is null when a
  commit holds only failures);
- `repair`: committed parts found damaged (`dropped`: their names; `repaired`: what was lost);
- `done`: the shard finished (`trajectories`, `failures`); its success marker `_SUCCESS.json`
  (the SuccessMarker) follows and names this record (`done_record`). Created exclusively like
  every record, so a run that lost the folder cannot finish a shard the new holder claimed.
Every record also holds its `seq`, `lease` (the writer's lease generation, null without one),
`time` and a random `token` (a retried create recognises its own bytes). A record's size
depends on its own part only (~400 bytes, plus ~20 per run of consecutive indices and per
failed sample, and ~150 per replica its turns went to, with at most BUSY_SPANS busy spans
each), never on the shard's size.
`ShardCheckpoint.load` lists the records and folds them in sequence order into one view; a part
no record lists (a crash between the part and its record) is an orphan and is never read. The
next attempt that holds the lease removes orphans and temporary files once its attempt record
is created (`remove_unlisted_files`). A shard job folds the log once per attempt and passes that
view along: its repair, its finished decision, its attempt record, every part and its done
record go through the one `ShardCheckpoint` (on S3 each fold is a listing plus a GET per record).

No compaction is needed: records are per part, never rewritten, and a shard has one per part
plus one per attempt. At the defaults 1M trajectories of the bundled demo (~290 bytes each in a
large part without logprobs, ~650 with) fill 5 to 10 parts of 64 MiB; the age bound
(`part_max_seconds`, 60) adds at most one part a minute per shard, e.g. 1,440 records for a
shard that generates for a day. At a few hundred bytes a record that is well under 0.1% of the
part bytes (tests/test_commit_records.py prints the ratio), and loading a shard is one listing
plus one read per record (16 at a time on S3).

Fencing. A writer creates number n+1 only after it knows records 0..n (it read or wrote them);
a number taken meanwhile fails its create. A run that takes the folder over (a higher lease
generation) claims the shard by creating the next number with its `attempt` record
(`ShardCheckpoint.start_attempt`). The old holder's late commit then finds its number taken,
re-checks the lease and raises LeaseLost (part_writer.py removes the part it had just written:
the folder is as the new holder left it); a commit that landed before the claim has a lower
number and the new holder reads it. A writer also refuses to commit after a record of a higher
lease than its own. So a record of a lower lease after one of a higher lease cannot be created
by genrun; the fold ignores such a record anyway (it could only be a write the fence exists to
refuse), and says so in the log. Records without a lease (library use, tests) are not fenced
and always folded. The run's finishing steps (merge, manifest.json, zip, report) write through
`FencedRunFolder` (fencing.py), which checks the lease before each write publishes.

A committed part can still be damaged later (a truncated copy, a bad disk, someone editing the
bucket): the shard job's first step, part_repair.py's `repair_damaged_parts`, finds it against
its record's size and sha256 and drops it with a `repair` record (`ShardCheckpoint.commit_repair`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from generation_core.build import genrun_build
from generation_core.errors import GenrunError, InputChanged
from generation_core.store.fencing import Fence
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import (
    COMMITS_DIR,
    FAILURES_DIR,
    LEASE_DIR,
    SHARDS_DIR,
    SUCCESS_FILE,
    PartEntry,
    SuccessMarker,
    commit_file,
    failures_file,
    record_from_dict,
    shard_file,
)

logger = logging.getLogger(__name__)


# --- fencing --------------------------------------------------------------------------------


class CheckpointConflict(RuntimeError):
    """A fenced commit found its number taken by another writer while this run still holds the
    folder (two writers of one shard in one run); the shard's next attempt resumes from it."""


# Commits that lose a race for their number read again and retry this often before giving up.
_CONFLICT_RETRIES = 5
# Commit records read at a time from an object store.
_PARALLEL_READS = 16


# --- records and their fold -----------------------------------------------------------------


def _encode_commit(payload: dict[str, Any]) -> bytes:
    # Compact: a part's record is mostly its sample keys.
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def sample_ranges(keys: list[str]) -> list[list[int]]:
    """Sample keys ("index:rollout_n") as runs of consecutive indices of one rollout number,
    `[rollout_n, first_index, last_index]`: a part's samples are nearly contiguous, so its
    record stays a few hundred bytes however many trajectories the part holds."""
    runs: list[list[int]] = []
    for rollout_n, index in sorted((int(n), int(i)) for i, n in (key.rsplit(":", 1) for key in keys)):
        if runs and runs[-1][0] == rollout_n and runs[-1][2] == index - 1:
            runs[-1][2] = index
        else:
            runs.append([rollout_n, index, index])
    return runs


def sample_keys(runs: list[list[int]]) -> list[str]:
    """The sample keys of `sample_ranges`, in (index, rollout_n) order."""
    return [
        f"{index}:{rollout_n}"
        for index, rollout_n in sorted((i, n) for n, first, last in runs for i in range(first, last + 1))
    ]


def commit_sequence(name: str) -> int | None:
    """The number a file name under commits/ stands for, or None for other files."""
    stem = name[:-5] if name.endswith(".json") else ""
    return int(stem) if len(stem) == 10 and stem.isdigit() else None


def read_commit_records(folder: StorageFolder, shard: str) -> tuple[list[int], list[dict[str, Any]]]:
    """Every commit record of `shard`, in sequence order: (sequence numbers, records)."""
    sequences = sorted(
        seq for seq in map(commit_sequence, folder.list(shard_file(shard, COMMITS_DIR))) if seq is not None
    )
    paths = [commit_file(shard, seq) for seq in sequences]
    if folder.is_local or len(paths) < _PARALLEL_READS:
        return sequences, [folder.read_json(path) for path in paths]
    # One GET per record on S3: many at a time.
    with ThreadPoolExecutor(_PARALLEL_READS) as pool:
        return sequences, list(pool.map(folder.read_json, paths))


def highest_recorded_lease(folder: StorageFolder) -> int:
    """The highest lease generation in the shards' newest commit records (0: none): a lease taken
    after lease/ was removed must number above it. One listing per shard and one read of its
    newest record (a record of a lower lease never follows a higher one)."""

    def newest_of(shard: str) -> int:
        sequences = [
            seq for seq in map(commit_sequence, folder.list(shard_file(shard, COMMITS_DIR))) if seq is not None
        ]
        if not sequences:
            return 0
        try:
            return int(folder.read_json(commit_file(shard, max(sequences))).get("lease") or 0)
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            return 0  # unreadable: the fold refuses it where it matters

    shards = folder.list(SHARDS_DIR)
    if folder.is_local or len(shards) < _PARALLEL_READS:
        return max(map(newest_of, shards), default=0)
    with ThreadPoolExecutor(_PARALLEL_READS) as pool:
        return max(pool.map(newest_of, shards), default=0)


@dataclass
class ShardCheckpoint:
    """What a shard has committed, folded from its commit records: its parts (with checksums)
    and the samples they hold. Readers (merge, status, the job) use this view; writers add one
    record at a time (`start_attempt`, `commit_part`, `commit_repair`)."""

    parts: list[PartEntry] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    """Sample keys ("index:rollout_n"), part after part in commit order ((index, rollout_n) order within a part)."""
    repaired_parts: list[dict[str, Any]] = field(default_factory=list)
    """Committed parts found damaged and dropped (their samples were generated again)."""
    failed: list[str] = field(default_factory=list)
    """Samples that failed in the latest attempt (never committed; pending for the next one)."""
    response_tokens: int = 0
    generated_tokens: int = 0
    attempts: int = 0
    lease: int | None = None
    """The highest run-lease generation among its records (None: written without a lease)."""
    rows_digest: str | None = None
    """The digest of the shard's dataset rows, as the first attempt that gave one recorded it."""
    builds: list[dict[str, Any]] = field(default_factory=list)
    """The genrun builds (build.genrun_build) that ran its attempts, each once, in order."""

    def __post_init__(self) -> None:
        # Not part of the view: the number the next commit record takes, each part's samples,
        # and the records the fold ignored (written under an older lease after a newer one).
        self.next_seq = 0
        self.part_samples: dict[str, list[str]] = {}
        self.ignored: list[int] = []
        self.failed_in_any_attempt: set[str] = set()
        """Every sample key a record counted as failed, in this attempt or an earlier one (`failed` starts
        empty each attempt): adaptive sampling keeps such a sample's prompt undecided (shard/adaptive.py)."""
        self.done_seq: int | None = None
        """The number of the `done` record that finished the shard, while no attempt or repair
        followed it (None: not finished)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, folder: StorageFolder, shard: str, fence: Fence | None = None) -> ShardCheckpoint:
        """The shard's committed state, folded from its commit records (empty when it has
        none). With `fence`, a run checks that no later run has claimed the shard (LeaseLost)."""
        checkpoint = cls.fold(*read_commit_records(folder, shard))
        if fence is not None and checkpoint.lease is not None and checkpoint.lease > fence.generation:
            fence.check(folder)
            # No later lease file, yet a later lease wrote here: lease/ lost its newest files.
            # RunLease.acquire numbers past every recorded lease when lease/ is incomplete.
            raise CheckpointConflict(
                f"{folder.display(shard_file(shard, COMMITS_DIR))} holds records of lease {checkpoint.lease}, later than this run's "
                f"lease {fence.generation}, but {folder.display(LEASE_DIR)} has no such lease file; this run stops. Remove all of "
                f"{folder.display(LEASE_DIR)} (only if no run is writing there) and run the same command again"
            )
        return checkpoint

    @classmethod
    def fold(cls, sequences: list[int], records: list[dict[str, Any]]) -> ShardCheckpoint:
        """The shard's committed state from its records as `read_commit_records` gave them (`load`
        without a fence, for a reader that also needs the records themselves: `genrun status`)."""
        checkpoint = cls()
        for seq, record in zip(sequences, records, strict=True):
            checkpoint._apply(seq, record)
        if sequences:
            checkpoint.next_seq = sequences[-1] + 1
        return checkpoint

    @classmethod
    def start_attempt(
        cls,
        folder: StorageFolder,
        shard: str,
        fence: Fence | None = None,
        rows_digest: str | None = None,
        *,
        loaded: ShardCheckpoint | None = None,
    ) -> ShardCheckpoint:
        """Load the shard and record the start of an attempt: the attempt's number, its lease
        and (optionally) the shard's rows digest, refused (nothing written) when it differs from
        the digest the shard first recorded; the failed list starts empty. Under a lease
        this record is the run's claim on the shard: a commit an earlier holder still has in
        flight takes a number at most this one, so it lands before the claim (and is read
        here) or finds its number taken and is refused. `loaded`: the shard's records as the
        caller just folded them (`load`, with the same fence), so that an attempt folds its
        commit log once; they are read again only when another writer took the next number."""
        checkpoint = loaded
        for _ in range(_CONFLICT_RETRIES):
            if checkpoint is None:
                checkpoint = cls.load(folder, shard, fence)
            if rows_digest is not None and checkpoint.rows_digest is not None and rows_digest != checkpoint.rows_digest:
                raise InputChanged(
                    f"the dataset rows of {shard} changed since its first attempt (digest {rows_digest[:12]}, recorded "
                    f"{checkpoint.rows_digest[:12]} in {folder.display(shard_file(shard, COMMITS_DIR))}): its committed trajectories "
                    "belong to other prompts. Restore the dataset, or write to another trainer.default_local_dir"
                )
            started = time.time()
            try:
                attempt = {
                    "kind": "attempt",
                    "attempt": checkpoint.attempts + 1,
                    "rows_digest": rows_digest,
                    "build": genrun_build(),
                }
                checkpoint._commit(folder, shard, attempt, fence)
            except CheckpointConflict:
                # An earlier holder's last commit (or another writer) took the number: read it, claim again.
                checkpoint = None
                continue
            if fence is not None:
                remove_unlisted_files(folder, shard, checkpoint, older_than=started)
            return checkpoint
        raise CheckpointConflict(
            f"could not claim {folder.display(shard_file(shard, COMMITS_DIR))}: it kept changing under this run"
        )

    def commit_part(
        self,
        folder: StorageFolder,
        shard: str,
        part: PartEntry | None,
        samples: list[str],
        failed: Sequence[str] = (),
        fence: Fence | None = None,
    ) -> None:
        """Record a written part with its samples (and the samples that failed since the last
        commit; `part` None: only failures). Raises LeaseLost (a later run took the folder) or
        CheckpointConflict (another writer of this run took the number), writing nothing."""
        payload: dict[str, Any] = {
            "kind": "part",
            "part": asdict(part) if part is not None else None,
            "samples": sample_ranges(samples),
            "failed": list(failed),
        }
        self._commit(folder, shard, payload, fence)

    def commit_repair(
        self, folder: StorageFolder, shard: str, repaired: list[dict[str, Any]], fence: Fence | None
    ) -> None:
        """The `repair` record: damaged parts dropped (part_repair.py found them), what was lost."""
        self._commit(
            folder,
            shard,
            {"kind": "repair", "dropped": [entry["name"] for entry in repaired], "repaired": repaired},
            fence,
        )

    def _commit(self, folder: StorageFolder, shard: str, payload: dict[str, Any], fence: Fence | None) -> None:
        """Create the next commit record exclusively and fold it into this view."""
        path = commit_file(shard, self.next_seq)
        if fence is not None:
            fence.check(folder)
            if self.lease is not None and self.lease > fence.generation:
                raise CheckpointConflict(
                    f"{folder.display(path)}: the shard belongs to a later run (lease {self.lease}); this run (lease {fence.generation}) stops"
                )
        # `token` makes the record ours alone: create_exclusive's retry after a lost answer
        # recognises its own bytes by it.
        record = dict(
            payload,
            seq=self.next_seq,
            lease=fence.generation if fence is not None else None,
            time=round(time.time(), 3),
            token=uuid.uuid4().hex,
        )
        if not folder.create_exclusive(path, _encode_commit(record)):
            # Taken since we read: a later run claimed the shard (LeaseLost), or else a second
            # writer of this run committed.
            if fence is not None:
                fence.check(folder)
            raise CheckpointConflict(
                f"{folder.display(path)} was created by another writer while this one (lease {record['lease']}) still holds the "
                "folder; this attempt stops, the next one resumes from the commits"
            )
        self._apply(self.next_seq, record)
        self.next_seq += 1

    def _apply(self, seq: int, record: dict[str, Any]) -> None:
        """Fold one record into the view (records in sequence order)."""
        lease = record.get("lease")
        if lease is not None and self.lease is not None and lease < self.lease:
            # Written under an older lease after a newer run's record: the protocol makes this
            # impossible (module docstring); were it there, it would be a write the fence refused.
            logger.warning("commit record %d (lease %s) follows a record of lease %s: ignored", seq, lease, self.lease)
            self.ignored.append(seq)
            return
        if lease is not None:
            self.lease = lease
        kind = record.get("kind")
        # Work after the shard was finished makes its marker stale.
        self.done_seq = None
        if kind == "done":
            self.done_seq = seq
        elif kind == "attempt":
            self._apply_attempt(record)
        elif kind == "part":
            self._apply_part(record)
        elif kind == "repair":
            self._apply_repair(record)
        else:
            raise GenrunError(
                f"commit record {seq} of kind {kind!r} was written by a newer genrun; finish the run with that version"
            )

    def _apply_attempt(self, record: dict[str, Any]) -> None:
        self.attempts = max(self.attempts, int(record.get("attempt") or 0))
        self.failed = []
        if self.rows_digest is None:
            self.rows_digest = record.get("rows_digest")
        if record.get("build") and record["build"] not in self.builds:
            self.builds.append(record["build"])

    def _apply_part(self, record: dict[str, Any]) -> None:
        part = record_from_dict(PartEntry, record["part"]) if record.get("part") is not None else None
        samples = sample_keys(record.get("samples") or [])
        if part is not None:
            self.parts.append(part)
            self.part_samples[part.name] = samples
            self.completed.extend(samples)
            self.response_tokens += part.response_tokens or 0
            self.generated_tokens += part.generated_tokens or 0
        self.failed.extend(record.get("failed") or [])
        self.failed_in_any_attempt.update(record.get("failed") or [])

    def _apply_repair(self, record: dict[str, Any]) -> None:
        dropped = set(record.get("dropped") or [])
        self.parts = [p for p in self.parts if p.name not in dropped]
        for name in dropped:
            self.part_samples.pop(name, None)
        self.completed = [key for p in self.parts for key in self.part_samples.get(p.name, [])]
        self.response_tokens = sum(p.response_tokens or 0 for p in self.parts)
        self.generated_tokens = sum(p.generated_tokens or 0 for p in self.parts)
        self.repaired_parts.extend(record.get("repaired") or [])


# --- the done record and the success marker -------------------------------------------------


def read_marker(folder: StorageFolder, shard: str, checkpoint: ShardCheckpoint | None = None) -> SuccessMarker | None:
    """The shard's success marker while it stands for the shard's state, else None: it must
    belong to the `done` record that ends the shard's records (`checkpoint`: the shard's records,
    folded, when the caller has them)."""
    path = shard_file(shard, SUCCESS_FILE)
    if not folder.exists(path):
        return None
    marker = SuccessMarker.from_dict(folder.read_json(path))
    checkpoint = checkpoint if checkpoint is not None else ShardCheckpoint.load(folder, shard)
    return marker if marker_stands(marker, checkpoint) else None


def marker_stands(marker: SuccessMarker, checkpoint: ShardCheckpoint) -> bool:
    """Whether a success marker stands for the shard's records (`read_marker`): it names the done
    record that ends them."""
    return checkpoint.done_seq is not None and marker.done_record == checkpoint.done_seq


def write_marker(
    folder: StorageFolder,
    marker: SuccessMarker,
    fence: Fence | None = None,
    checkpoint: ShardCheckpoint | None = None,
) -> None:
    """Finish the shard: its `done` commit record, created exclusively under the next number
    (with `fence`, refused once a later run claimed the shard: LeaseLost), then the success
    marker that names it. A marker that a run which lost the folder still writes after its
    fence check names a done record that is not the shard's last: read_marker ignores it and
    the shard is finished again. `checkpoint`: the attempt's own view of the records (the shard
    job's, which committed every part through it); None folds them here. A record some other
    writer created since makes the done record's number taken: CheckpointConflict, no marker."""
    if checkpoint is None:
        checkpoint = ShardCheckpoint.load(folder, marker.shard, fence)
    checkpoint._commit(
        folder,
        marker.shard,
        {"kind": "done", "trajectories": marker.num_trajectories, "failures": marker.failures},
        fence,
    )
    marker.done_record = checkpoint.done_seq
    if fence is not None:
        fence.check(folder)
    folder.put_json(shard_file(marker.shard, SUCCESS_FILE), marker.to_dict())


# --- what a killed writer left, and the failure log -----------------------------------------


def _modified(entry: dict[str, Any]) -> float | None:
    """A listing entry's modification time (local disk: `mtime`; S3: `LastModified`), or None."""
    modified: Any = entry.get("mtime", entry.get("LastModified"))  # a datetime (S3) or a number
    if hasattr(modified, "timestamp"):
        return modified.timestamp()
    return float(modified) if isinstance(modified, int | float) else None


def remove_unlisted_files(
    folder: StorageFolder, shard: str, checkpoint: ShardCheckpoint, *, older_than: float
) -> list[str]:
    """Remove what a killed writer left in the shard's folder: parts that no live record lists
    and temporary files (`.tmp-*`, local disk), both older than `older_than`; returns their
    names. Called by an attempt under the lease right after its attempt record: no writer of an
    earlier lease can list a part any more (its commit would need a number the claim took),
    and the age spares whatever this run is writing now. Parts a `repair` record dropped stay
    (the damaged file is the evidence of what was lost)."""
    keep = {part.name for part in checkpoint.parts} | {str(entry.get("name")) for entry in checkpoint.repaired_parts}
    removed = []
    for directory in (shard_file(shard), shard_file(shard, COMMITS_DIR), shard_file(shard, FAILURES_DIR)):
        try:
            entries = folder.fs.ls(folder.path(directory), detail=True)
        except FileNotFoundError:
            continue
        except OSError as exc:
            # Only tidying: what stays is never read, and the next attempt tries again.
            logger.warning(
                "%s: could not list %s to remove what a killed writer left (%s)", shard, folder.display(directory), exc
            )
            continue
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            modified = _modified(entry)
            if entry.get("type") == "directory" or modified is None or modified >= older_than:
                continue
            orphan_part = (
                directory == shard_file(shard)
                and name.startswith("batch-")
                and name.endswith(".parquet")
                and name not in keep
            )
            if orphan_part or name.startswith(".tmp-"):
                folder.remove(f"{directory}/{name}")
                removed.append(f"{directory}/{name}")
    if removed:
        logger.info(
            "%s: removed %d file(s) no commit record lists, left by a killed writer: %s",
            shard,
            len(removed),
            ", ".join(removed),
        )
    return removed


def write_failure_log(folder: StorageFolder, shard: str, seq: int, lines: str, fence: Fence | None = None) -> None:
    """The failure log lines of the samples commit record `seq` counted as failed, in a file of
    their own: nothing is ever rewritten (S3 cannot append), so the bytes a shard writes grow with
    its failures, not with their square. Only the writer of record `seq` writes its file; with a
    fence, not after a later run took the folder over."""
    if fence is not None:
        fence.check(folder)
    folder.put_atomic(failures_file(shard, seq), lines.encode())


def read_failure_log(folder: StorageFolder, shard: str) -> list[dict[str, Any]]:
    """Every failure the shard logged, oldest first: one file per commit record that counted failures."""
    paths = [
        shard_file(shard, f"{FAILURES_DIR}/{name}")
        for name in folder.list(shard_file(shard, FAILURES_DIR))
        if name.endswith(".jsonl")
    ]
    return [
        json.loads(line) for path in paths for line in folder.read_bytes(path).decode().splitlines() if line.strip()
    ]
