"""The run folder: every name in it, its typed records, and the one verifier of committed parts.

```
run.json                      resolved config, fingerprint, versions, shard plan (written once)
lease/00000001.json           who holds the folder (lease.py)
shards/shard-00003/
  batch-00000-<uid>.parquet   immutable part: unpadded trajectories
  commits/0000000000.json     numbered commit records, each created exclusively (ShardCheckpoint)
  failures/0000000004.jsonl   samples that failed after retries, with the error: one file per
                              commit record that counts failures, named by its number
                              (failures.jsonl: one file rewritten at every commit, earlier versions)
  last_error.json             the last failed attempt's error (until the shard finishes)
  _SUCCESS.json               ShardManifest, written last, after the `done` commit record it names
trajectories.pkl              merged DataProto, or trajectories.json + trajectories-NNNNN.pkl chunks
trajectories.zip              upload artifact
manifest.json                 the run summary
```

Nothing else spells these names.

Commit records. A shard's progress is an append-only sequence `commits/<seq:010d>.json`, each
record created under a name that must be free (`RunFolder.create_exclusive`: a hard link on
local disk, `If-None-Match: *` on S3), so neither append nor rename is needed. Kinds:
- `attempt`: an attempt starts (`attempt` number, `lease`, optional `rows_digest`, the genrun
  `build` that runs it); the failed list starts empty again;
- `part`: one part (`part`: its PartEntry with size, sha256 and token counts; `samples`: its own
  sample keys as runs `[rollout_n, first_index, last_index]`; `failed`: sample keys that failed
  since the previous commit; `part` is null when a commit holds only failures);
- `repair`: committed parts found damaged (`dropped`: their names; `repaired`: what was lost);
- `done`: the shard finished (`trajectories`, `failures`); its success marker `_SUCCESS.json`
  (the ShardManifest) follows and names this record (`done_record`). Created exclusively like
  every record, so a run that lost the folder cannot finish a shard the new holder claimed.
Every record also holds its `seq`, `lease` (the writer's lease generation, null without one),
`time` and a random `token` (a retried create recognises its own bytes). A record's size
depends on its own part only (~400 bytes, plus ~20 per run of consecutive indices and per
failed sample), never on the shard's size.
`ShardCheckpoint.load` lists the records and folds them in sequence order into one view; a part
no record lists (a crash between the part and its record) is an orphan and is never read. The
next attempt that holds the lease removes orphans and temporary files once its attempt record
is created (`remove_unlisted_files`).

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
and always folded.

A committed part can still be damaged later (a truncated copy, a bad disk, someone editing the
bucket): `repair_shard` finds it against its record's size and sha256, drops it (its samples are
pending again) with a `repair` record, so a loss is reported, never silent; the damaged file
stays where it is, listed by no live record.

A folder of the earlier format (run.json `fingerprint_version` < 3, or a shard with
`checkpoint.json` and no commits) is refused (`check_run_folder`): finish it with the genrun
that wrote it, or start a new output folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from generation_core.build import genrun_build, refusal_hint
from generation_core.errors import GenrunError
from generation_core.run_record import RunRecord
from generation_core.secrets import without_secrets
from generation_core.storage import RunFolder

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"
LEASE_DIR = "lease"
SHARDS_DIR = "shards"
CHECKPOINT_FILE = "checkpoint.json"
"""A shard checkpoint of the earlier format (one file rewritten per commit): only to refuse it."""
COMMITS_DIR = "commits"
SUCCESS_FILE = "_SUCCESS.json"
LAST_ERROR_FILE = "last_error.json"
FAILURES_DIR = "failures"
FAILURES_FILE = "failures.jsonl"
"""The failure log of earlier versions (one file rewritten whole at every commit): read, never written."""
MERGED_FILE = "trajectories.pkl"
CHUNK_INDEX_FILE = "trajectories.json"
CHUNK_FILE_PREFIX = "trajectories-"
ZIP_FILE = "trajectories.zip"


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}"


def shard_file(shard: str, name: str = "") -> str:
    """`shards/<shard>/<name>` (the shard's folder when `name` is empty)."""
    return f"{SHARDS_DIR}/{shard}/{name}" if name else f"{SHARDS_DIR}/{shard}"


def new_part_name(number: int) -> str:
    # A fresh name per write: a part from a crashed or concurrent attempt is never overwritten.
    return f"batch-{number:05d}-{uuid.uuid4().hex[:8]}.parquet"


def failures_file(shard: str, seq: int) -> str:
    """`shards/<shard>/failures/<seq:010d>.jsonl`: the failures commit record `seq` counts."""
    return shard_file(shard, f"{FAILURES_DIR}/{seq:010d}.jsonl")


def commit_file(shard: str, seq: int) -> str:
    """`shards/<shard>/commits/<seq:010d>.json`: the shard's commit record number `seq`."""
    return shard_file(shard, f"{COMMITS_DIR}/{seq:010d}.json")


def chunk_file_name(chunk: int) -> str:
    return f"{CHUNK_FILE_PREFIX}{chunk:05d}.pkl"


def is_chunk_file(name: str) -> bool:
    return name.startswith(CHUNK_FILE_PREFIX) and name.endswith(".pkl")


def lease_file(generation: int) -> str:
    return f"{LEASE_DIR}/{generation:08d}.json"


def lease_generation(name: str) -> int | None:
    """The generation a file name under lease/ stands for, or None for other files."""
    return int(name[:-5]) if name.endswith(".json") and name[:-5].isdigit() else None


class Fence(Protocol):
    """The run's lease as writers see it (lease.LeaseFence): `check` raises LeaseLost once a
    later run has taken the folder over."""

    @property
    def generation(self) -> int: ...  # read-only: LeaseFence is frozen

    def check(self, folder: RunFolder) -> None: ...


class CheckpointConflict(RuntimeError):
    """A fenced commit found its number taken by another writer while this run still holds the
    folder (two writers of one shard in one run); the shard's next attempt resumes from it."""


# Commits that lose a race for their number read again and retry this often before giving up.
_CONFLICT_RETRIES = 5
# Commit records read at a time from an object store.
_PARALLEL_READS = 16


def _from_dict(cls, payload: dict[str, Any]):
    """Build a record from JSON, ignoring keys a newer or older writer added."""
    known = {f.name for f in fields(cls)}
    return cls(**{key: value for key, value in payload.items() if key in known})


# --- records ----------------------------------------------------------------------------------


@dataclass
class PartEntry:
    """One committed part, as its commit record lists it."""

    name: str
    count: int
    """Trajectories in the part."""
    bytes: int
    sha256: str
    response_tokens: int | None = None
    """Response tokens of its trajectories (tool tokens included); None in parts of early versions."""
    generated_tokens: int | None = None
    """Model tokens (response_mask) of its trajectories."""


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
    return [f"{index}:{rollout_n}" for index, rollout_n in sorted((i, n) for n, first, last in runs for i in range(first, last + 1))]


def commit_sequence(name: str) -> int | None:
    """The number a file name under commits/ stands for, or None for other files."""
    stem = name[:-5] if name.endswith(".json") else ""
    return int(stem) if len(stem) == 10 and stem.isdigit() else None


def legacy_checkpoint_error(folder: RunFolder, shard: str) -> GenrunError:
    version = _genrun_that_wrote(folder)
    return GenrunError(
        f"output folder {folder.display()} holds shard progress in the earlier format ({shard_file(shard, CHECKPOINT_FILE)}, no "
        f"{COMMITS_DIR}/; run.json names {'genrun ' + version if version else 'no genrun version'}): this genrun keeps numbered commit "
        f"records and cannot resume it. {_finish_or_start_fresh(folder)}"
    )


def read_commit_records(folder: RunFolder, shard: str) -> tuple[list[int], list[dict[str, Any]]]:
    """Every commit record of `shard`, in sequence order: (sequence numbers, records)."""
    sequences = sorted(seq for seq in map(commit_sequence, folder.list(shard_file(shard, COMMITS_DIR))) if seq is not None)
    paths = [commit_file(shard, seq) for seq in sequences]
    if folder.is_local or len(paths) < _PARALLEL_READS:
        return sequences, [folder.read_json(path) for path in paths]
    # One GET per record on S3: many at a time.
    with ThreadPoolExecutor(_PARALLEL_READS) as pool:
        return sequences, list(pool.map(folder.read_json, paths))


def highest_recorded_lease(folder: RunFolder) -> int:
    """The highest lease generation in the shards' newest commit records (0: none): a lease taken
    after lease/ was removed must number above it. One listing per shard and one read of its
    newest record (a record of a lower lease never follows a higher one)."""

    def newest_of(shard: str) -> int:
        sequences = [seq for seq in map(commit_sequence, folder.list(shard_file(shard, COMMITS_DIR))) if seq is not None]
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
    record at a time (`start_attempt`, `commit_part`, `drop_damaged_parts`)."""

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
        self.rejected_parts: list[str] = []
        """Parts whose record's count differs from its sample keys (never read)."""
        self.done_seq: int | None = None
        """The number of the `done` record that finished the shard, while no attempt or repair
        followed it (None: not finished, or finished by a version that wrote no done record)."""
        self.has_done_record = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, folder: RunFolder, shard: str, fence: Fence | None = None) -> ShardCheckpoint:
        """The shard's committed state, folded from its commit records (empty when it has
        none). With `fence`, a run checks that no later run has claimed the shard (LeaseLost)."""
        checkpoint = cls()
        sequences, records = read_commit_records(folder, shard)
        if not sequences and folder.exists(shard_file(shard, CHECKPOINT_FILE)):
            raise legacy_checkpoint_error(folder, shard)
        for seq, record in zip(sequences, records, strict=True):
            checkpoint._apply(seq, record)
        if sequences:
            checkpoint.next_seq = sequences[-1] + 1
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
    def start_attempt(cls, folder: RunFolder, shard: str, fence: Fence | None = None, rows_digest: str | None = None) -> ShardCheckpoint:
        """Load the shard and record the start of an attempt: the attempt's number, its lease
        and (optionally) the shard's rows digest, refused (nothing written) when it differs from
        the digest the shard first recorded; the failed list starts empty. Under a lease
        this record is the run's claim on the shard: a commit an earlier holder still has in
        flight takes a number at most this one, so it lands before the claim (and is read
        here) or finds its number taken and is refused."""
        for _ in range(_CONFLICT_RETRIES):
            checkpoint = cls.load(folder, shard, fence)
            if rows_digest is not None and checkpoint.rows_digest is not None and rows_digest != checkpoint.rows_digest:
                raise GenrunError(
                    f"the dataset rows of {shard} changed since its first attempt (digest {rows_digest[:12]}, recorded "
                    f"{checkpoint.rows_digest[:12]} in {folder.display(shard_file(shard, COMMITS_DIR))}): its committed trajectories "
                    "belong to other prompts. Restore the dataset, or write to another trainer.default_local_dir"
                )
            started = time.time()
            try:
                attempt = {"kind": "attempt", "attempt": checkpoint.attempts + 1, "rows_digest": rows_digest, "build": genrun_build()}
                checkpoint._commit(folder, shard, attempt, fence)
            except CheckpointConflict:
                continue  # an earlier holder's last commit (or another writer) took the number: read it, claim again
            if fence is not None:
                remove_unlisted_files(folder, shard, checkpoint, older_than=started)
            return checkpoint
        raise CheckpointConflict(f"could not claim {folder.display(shard_file(shard, COMMITS_DIR))}: it kept changing under this run")

    def commit_part(self, folder: RunFolder, shard: str, part: PartEntry | None, samples: list[str], failed: Sequence[str] = (), fence: Fence | None = None) -> None:
        """Record a written part with its samples (and the samples that failed since the last
        commit; `part` None: only failures). Raises LeaseLost (a later run took the folder) or
        CheckpointConflict (another writer of this run took the number), writing nothing."""
        payload: dict[str, Any] = {"kind": "part", "part": asdict(part) if part is not None else None, "samples": sample_ranges(samples), "failed": list(failed)}
        self._commit(folder, shard, payload, fence)

    def _commit(self, folder: RunFolder, shard: str, payload: dict[str, Any], fence: Fence | None) -> None:
        """Create the next commit record exclusively and fold it into this view."""
        path = commit_file(shard, self.next_seq)
        if fence is not None:
            fence.check(folder)
            if self.lease is not None and self.lease > fence.generation:
                raise CheckpointConflict(f"{folder.display(path)}: the shard belongs to a later run (lease {self.lease}); this run (lease {fence.generation}) stops")
        # `token` makes the record ours alone: create_exclusive's retry after a lost answer
        # recognises its own bytes by it.
        record = dict(payload, seq=self.next_seq, lease=fence.generation if fence is not None else None, time=round(time.time(), 3), token=uuid.uuid4().hex)
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
        if kind != "done":
            self.done_seq = None  # work after the shard was finished: its marker is stale
        if kind == "done":
            self.done_seq, self.has_done_record = seq, True
        elif kind == "attempt":
            self.attempts = max(self.attempts, int(record.get("attempt") or 0))
            self.failed = []
            if self.rows_digest is None:
                self.rows_digest = record.get("rows_digest")
            if record.get("build") and record["build"] not in self.builds:
                self.builds.append(record["build"])
        elif kind == "part":
            part = _from_dict(PartEntry, record["part"]) if record.get("part") is not None else None
            samples = sample_keys(record.get("samples") or [])
            if part is not None and part.count != len(samples):
                # A record that does not say which samples its part holds (a commit that raced
                # the attempt's discard in genrun 0.1.0 could list none): folding it would count
                # trajectories no key names, or keys of trajectories that are not there. The part
                # is left unread (an orphan) and its samples stay pending: nothing is lost or
                # duplicated.
                logger.warning(
                    "commit record %d lists part %s with %d trajectories but %d sample keys: the part is ignored, its samples "
                    "will be generated again", seq, part.name, part.count, len(samples),
                )
                self.rejected_parts.append(part.name)
                part = None
            if part is not None:
                self.parts.append(part)
                self.part_samples[part.name] = samples
                self.completed.extend(samples)
                self.response_tokens += part.response_tokens or 0
                self.generated_tokens += part.generated_tokens or 0
            self.failed.extend(record.get("failed") or [])
        elif kind == "repair":
            dropped = set(record.get("dropped") or [])
            self.parts = [p for p in self.parts if p.name not in dropped]
            for name in dropped:
                self.part_samples.pop(name, None)
            self.completed = [key for p in self.parts for key in self.part_samples.get(p.name, [])]
            self.response_tokens = sum(p.response_tokens or 0 for p in self.parts)
            self.generated_tokens = sum(p.generated_tokens or 0 for p in self.parts)
            self.repaired_parts.extend(record.get("repaired") or [])
        else:
            raise GenrunError(f"commit record {seq} of kind {kind!r} was written by a newer genrun; finish the run with that version")


@dataclass
class AttemptStats:
    """What one attempt at a shard did (zero when it found nothing to do)."""

    trajectories: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    skipped: bool = False
    """The shard was finished already: this attempt generated nothing."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds inside each stage (serialization, storage, postprocess), beside generation."""
    engine: dict[str, int] = field(default_factory=dict)
    """Engine requests, requests resent after a transient error, replica failures failed over."""
    peak_rss_bytes: int = 0
    """Peak resident memory of the process that ran the shard."""
    worker: dict[str, Any] = field(default_factory=dict)
    """Where it ran: Ray node id, pid, GPU ids (none: the replicas own the GPUs)."""


@dataclass
class ShardManifest:
    """A finished shard: what `_SUCCESS.json` holds and what a shard job returns."""

    shard: str
    shard_id: int
    range: list[int]
    """Dataset positions [start, end) of the shard."""
    num_trajectories: int
    expected_trajectories: int
    failures: int = 0
    """Samples that failed in the last attempt; a shard with failures is run again by the next run."""
    failed_samples: list[str] = field(default_factory=list)
    response_tokens: int = 0
    generated_tokens: int = 0
    parts: list[PartEntry] = field(default_factory=list)
    repaired_parts: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 1
    last_attempt: AttemptStats = field(default_factory=AttemptStats)
    filtered_overlong: int = 0
    """Rows of the shard's range dropped as longer than data.max_prompt_length (never generated)."""
    done_record: int | None = None
    """The number of the shard's `done` commit record this marker belongs to (None: a marker of
    a version that wrote none)."""

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> ShardManifest:
        manifest = _from_dict(cls, payload)
        manifest.parts = [_from_dict(PartEntry, part) for part in payload.get("parts", [])]
        manifest.last_attempt = _from_dict(AttemptStats, payload.get("last_attempt") or {})
        return manifest

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_skipped(self) -> ShardManifest:
        """This manifest for an attempt that found the shard finished and did nothing."""
        skipped = ShardManifest.from_dict(self.to_dict())
        skipped.last_attempt = AttemptStats(skipped=True)
        return skipped

    @property
    def tokens_per_second(self) -> float:
        seconds = self.last_attempt.seconds
        return round(self.last_attempt.generated_tokens / seconds, 2) if seconds else 0.0


def read_marker(folder: RunFolder, shard: str, checkpoint: ShardCheckpoint | None = None) -> ShardManifest | None:
    """The shard's success marker while it stands for the shard's state, else None: it must
    belong to the `done` record that ends the shard's records (`checkpoint`: the shard's records,
    folded, when the caller has them). A marker of a version that wrote no done records stands
    while the shard has none (its folder is read as that version left it)."""
    path = shard_file(shard, SUCCESS_FILE)
    if not folder.exists(path):
        return None
    marker = ShardManifest.from_dict(folder.read_json(path))
    checkpoint = checkpoint if checkpoint is not None else ShardCheckpoint.load(folder, shard)
    if not checkpoint.has_done_record:
        return marker
    return marker if checkpoint.done_seq is not None and marker.done_record == checkpoint.done_seq else None


def write_marker(folder: RunFolder, manifest: ShardManifest, fence: Fence | None = None) -> None:
    """Finish the shard: its `done` commit record, created exclusively under the next number
    (with `fence`, refused once a later run claimed the shard: LeaseLost), then the success
    marker that names it. A marker that a run which lost the folder still writes after its
    fence check names a done record that is not the shard's last: read_marker ignores it and
    the shard is finished again."""
    checkpoint = ShardCheckpoint.load(folder, manifest.shard, fence)
    checkpoint._commit(folder, manifest.shard, {"kind": "done", "trajectories": manifest.num_trajectories, "failures": manifest.failures}, fence)
    manifest.done_record = checkpoint.done_seq
    if fence is not None:
        fence.check(folder)
    folder.put_json(shard_file(manifest.shard, SUCCESS_FILE), manifest.to_dict())


def write_last_error(folder: RunFolder, shard: str, payload: dict[str, Any]) -> None:
    folder.put_json(shard_file(shard, LAST_ERROR_FILE), payload)


def read_last_error(folder: RunFolder, shard: str) -> dict[str, Any] | None:
    path = shard_file(shard, LAST_ERROR_FILE)
    return folder.read_json(path) if folder.exists(path) else None


def _modified(entry: dict[str, Any]) -> float | None:
    """A listing entry's modification time (local disk: `mtime`; S3: `LastModified`), or None."""
    modified: Any = entry.get("mtime", entry.get("LastModified"))  # a datetime (S3) or a number
    if hasattr(modified, "timestamp"):
        return modified.timestamp()
    return float(modified) if isinstance(modified, int | float) else None


def remove_unlisted_files(folder: RunFolder, shard: str, checkpoint: ShardCheckpoint, *, older_than: float) -> list[str]:
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
            logger.warning("%s: could not list %s to remove what a killed writer left (%s)", shard, folder.display(directory), exc)
            continue
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            modified = _modified(entry)
            if entry.get("type") == "directory" or modified is None or modified >= older_than:
                continue
            orphan_part = directory == shard_file(shard) and name.startswith("batch-") and name.endswith(".parquet") and name not in keep
            if orphan_part or name.startswith(".tmp-"):
                folder.remove(f"{directory}/{name}")
                removed.append(f"{directory}/{name}")
    if removed:
        logger.info("%s: removed %d file(s) no commit record lists, left by a killed writer: %s", shard, len(removed), ", ".join(removed))
    return removed


def write_failure_log(folder: RunFolder, shard: str, seq: int, lines: str, fence: Fence | None = None) -> None:
    """The failure log lines of the samples commit record `seq` counted as failed, in a file of
    their own: nothing is ever rewritten (S3 cannot append), so the bytes a shard writes grow with
    its failures, not with their square. Only the writer of record `seq` writes its file; with a
    fence, not after a later run took the folder over."""
    if fence is not None:
        fence.check(folder)
    folder.put_atomic(failures_file(shard, seq), lines.encode())


def read_failure_log(folder: RunFolder, shard: str) -> list[dict[str, Any]]:
    """Every failure the shard logged, oldest first: the earlier versions' failures.jsonl, then
    one file per commit record that counted failures."""
    paths = [shard_file(shard, FAILURES_FILE)] if folder.exists(shard_file(shard, FAILURES_FILE)) else []
    paths += [shard_file(shard, f"{FAILURES_DIR}/{name}") for name in folder.list(shard_file(shard, FAILURES_DIR)) if name.endswith(".jsonl")]
    return [json.loads(line) for path in paths for line in folder.read_bytes(path).decode().splitlines() if line.strip()]


# --- run.json ---------------------------------------------------------------------------------


FINGERPRINT_VERSION = 3
"""The recipe of the run fingerprint (generation_core/fingerprint.py) and the run-folder format that
run.json's `fingerprint_version` names; a run.json without one was written by recipe 1. Bump
it when either changes, and say in FINGERPRINT_ADDED what the new version covers."""
FINGERPRINT_ADDED = {
    2: "engine_kwargs (e.g. instant.response_tokens, hf.dtype, hf.ignore_eos, remote.model), the model's files, "
    "the agent-loop YAML and its classes' source, the tool config",
    3: "the dataset from its file metadata plus a sampled content hash, and shard progress kept as numbered "
    f"commit records (shards/<shard>/{COMMITS_DIR}/) instead of one checkpoint.json",
}
FOLDER_FORMAT_SINCE = 3
"""The first version whose run folders this genrun resumes (shard progress as commit records)."""


def _genrun_that_wrote(folder: RunFolder) -> str | None:
    """The genrun version run.json records, if any."""
    try:
        version = RunRecord.from_json(folder.read_json(RUN_FILE)).versions.get("genrun")
    except (FileNotFoundError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return version if isinstance(version, str) and version not in ("", "unknown") else None


def _finish_or_start_fresh(folder: RunFolder) -> str:
    version = _genrun_that_wrote(folder)
    install = f" (pip install genrun=={version})" if version else ""
    return (
        f"Nothing was changed there. Finish it with that genrun version{install}. To start fresh, set another "
        "trainer.default_local_dir (or trainer.experiment_name, when that folder is derived from it) or delete that folder"
    )


def _legacy_shard(folder: RunFolder) -> str | None:
    """A shard holding a checkpoint.json and no commit records (the earlier format), or None."""
    for shard in folder.list(SHARDS_DIR):
        names = folder.list(shard_file(shard))
        if CHECKPOINT_FILE in names and COMMITS_DIR not in names:
            return shard
    return None


def check_run_folder(folder: RunFolder, run_fingerprint: str) -> RunRecord | None:
    """The folder's run record when it already belongs to this run (a resume), None when it
    holds no run; refuses a folder of another run or of an earlier folder format, changing nothing."""
    if not folder.exists(RUN_FILE):
        if folder.list(SHARDS_DIR):
            # Shard progress without the run.json that says which run it belongs to (run.json is
            # written before any shard): adopting it could mix another run's trajectories in.
            raise GenrunError(
                f"output folder {folder.display()} holds {folder.display(SHARDS_DIR)} but no {RUN_FILE}, so nothing says which run "
                "wrote it: this run will not adopt it. Nothing was changed there. Set another trainer.default_local_dir (or "
                "trainer.experiment_name, when that folder is derived from it), or delete that folder"
            )
        return None
    existing = RunRecord.from_json(folder.read_json(RUN_FILE))
    written_by = existing.fingerprint_version
    if isinstance(written_by, int) and written_by < FOLDER_FORMAT_SINCE:
        uncovered = "; ".join(FINGERPRINT_ADDED.get(v, f"recipe {v}'s inputs") for v in range(written_by + 1, FINGERPRINT_VERSION + 1))
        version = _genrun_that_wrote(folder)
        raise GenrunError(
            f"output folder {folder.display()} was written by an earlier genrun whose fingerprint did not cover {uncovered} "
            f"({'genrun ' + version if version else 'its version is not recorded'}, fingerprint version {written_by}; this genrun's "
            f"is {FINGERPRINT_VERSION}): this genrun cannot resume it. {_finish_or_start_fresh(folder)}"
        )
    if existing.fingerprint == run_fingerprint:
        legacy = _legacy_shard(folder)
        if legacy is not None:
            raise legacy_checkpoint_error(folder, legacy)
        return existing
    if written_by == FINGERPRINT_VERSION:
        what = (
            f"holds a different run (fingerprint {str(existing.fingerprint)[:12]}, this one is {run_fingerprint[:12]}): "
            f"the config, dataset, user code or versions changed (its config is in {folder.display(RUN_FILE)}){refusal_hint(existing.build)}. "
            "Nothing was changed there."
        )
    else:
        what = (
            f"holds a different run or the same run written by a genrun with another fingerprint recipe (fingerprint version "
            f"{written_by!r}, this genrun's is {FINGERPRINT_VERSION}). Nothing was changed there. Finish it with that genrun version."
        )
    raise GenrunError(
        f"output folder {folder.display()} {what} To start fresh, set another trainer.default_local_dir "
        "(or trainer.experiment_name, when that folder is derived from it) or delete that folder"
    )


def claim_run_folder(folder: RunFolder, run_record: RunRecord) -> None:
    """Write run.json for a new run (the caller holds the lease), or confirm a resume."""
    if check_run_folder(folder, str(run_record.fingerprint)) is None:
        folder.put_json(RUN_FILE, run_record.to_json())


def read_run_record(folder: RunFolder) -> RunRecord:
    if not folder.exists(RUN_FILE):
        raise GenrunError(f"{folder.display()} is not a genrun run folder (no {RUN_FILE})")
    return RunRecord.from_json(folder.read_json(RUN_FILE))


def config_without_secrets(container: dict[str, Any]) -> dict[str, Any]:
    """The resolved config with every secret masked (generation_core.secrets): run.json, logs
    and trackers never hold credentials."""
    return without_secrets(container)


# --- committed parts and their verification -----------------------------------------------------


class DamagedPart(GenrunError):
    """A committed part no longer matches what its checkpoint recorded."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class CommittedPartRef:
    path: str
    sha256: str


def committed_parts(folder: RunFolder) -> list[CommittedPartRef]:
    """Every part a shard checkpoint lists (orphans of crashed writes are not), shard by shard."""
    parts: list[CommittedPartRef] = []
    for shard in folder.list(SHARDS_DIR):
        checkpoint = ShardCheckpoint.load(folder, shard)
        parts.extend(CommittedPartRef(shard_file(shard, p.name), p.sha256) for p in checkpoint.parts)
    return parts


def read_verified_part(folder: RunFolder, part: CommittedPartRef) -> bytes:
    try:
        data = folder.read_bytes(part.path)
    except FileNotFoundError:
        raise DamagedPart(f"part {folder.display(part.path)}, listed by its shard's checkpoint, is missing", part.path) from None
    if hashlib.sha256(data).hexdigest() != part.sha256:
        raise DamagedPart(f"part {folder.display(part.path)} does not match the checksum its checkpoint recorded", part.path)
    return data


def part_damage(folder: RunFolder, shard: str, part: PartEntry, *, sizes: dict[str, int] | None = None) -> str | None:
    """Why a committed part is damaged, or None when it is intact. With `sizes` (one listing of
    the shard's folder) only presence and size are checked; otherwise the sha256 too."""
    if sizes is not None:
        size = sizes.get(part.name)
        if size is None:
            return "missing"
        return f"size {size} bytes, checkpoint recorded {part.bytes}" if size != part.bytes else None
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
    folder: RunFolder, shard: str, checkpoint: ShardCheckpoint, reasons: dict[str, str], fence: Fence | None = None
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
                shard_file(shard, part.name), reasons[part.name], samples,
            )
    # Marker first: a crash between the two leaves an unfinished shard whose next attempt
    # finds the same damage again. A run that lost its lease stops before either.
    if fence is not None:
        fence.check(folder)
    folder.remove(shard_file(shard, SUCCESS_FILE))
    if repaired:
        checkpoint._commit(folder, shard, {"kind": "repair", "dropped": [entry["name"] for entry in repaired], "repaired": repaired}, fence)
    return checkpoint


def repair_shard(folder: RunFolder, shard: str, *, size_only: bool = False, fence: Fence | None = None, checkpoint: ShardCheckpoint | None = None) -> int:
    """Verify a shard's committed parts and drop the damaged ones; returns how many were dropped.
    `size_only`: one listing, no reads (catches missing and truncated parts; a same-size
    corruption needs the full check). `fence`: the run's lease, when the caller holds one.
    `checkpoint`: the shard's records as the caller just loaded them."""
    checkpoint = checkpoint if checkpoint is not None else ShardCheckpoint.load(folder, shard)
    if not checkpoint.parts:
        return 0
    sizes = folder.list_sizes(shard_file(shard)) if size_only else None
    reasons = {part.name: reason for part in checkpoint.parts if (reason := part_damage(folder, shard, part, sizes=sizes))}
    if reasons:
        drop_damaged_parts(folder, shard, checkpoint, reasons, fence)
    return len(reasons)


def mark_for_repair(folder: RunFolder, damaged: DamagedPart, fence: Fence | None = None) -> None:
    """After the merge found `damaged`: drop it so the next run regenerates its samples."""
    _, shard, part_name = damaged.path.split("/", 2)
    checkpoint = ShardCheckpoint.load(folder, shard)
    drop_damaged_parts(folder, shard, checkpoint, {part_name: "sha256 does not match the checkpoint (found by the merge)"}, fence)


# --- merged output ------------------------------------------------------------------------------


class FencedRunFolder(RunFolder):
    """The run folder as the run's finishing steps write it (merge, manifest.json, zip, report):
    the same storage, with the lease checked immediately before each write publishes (before an
    atomic put, a create, a removal, and at the end of a streamed write, before its file
    appears). A run that lost the folder (LeaseLost) publishes nothing over the new holder's
    output; a streamed file it was writing is discarded."""

    def __init__(self, folder: RunFolder, fence: Fence):
        self.__dict__.update(folder.__dict__)  # the same filesystem, credentials and retry policy
        self.fence = fence

    def put_atomic(self, relative: str, data: bytes) -> None:
        self.fence.check(self)
        super().put_atomic(relative, data)

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        self.fence.check(self)
        return super().create_exclusive(relative, data)

    def put_if_version(self, relative: str, data: bytes, version: str | None) -> str:
        self.fence.check(self)
        return super().put_if_version(relative, data, version)

    def remove(self, relative: str) -> None:
        self.fence.check(self)
        super().remove(relative)

    @contextlib.contextmanager
    def open_write(self, relative: str):
        with super().open_write(relative) as handle:
            yield handle
            self.fence.check(self)  # raised inside the block: the writer discards the file


def fenced(folder: RunFolder, fence: Fence | None) -> RunFolder:
    """`folder` whose writes check `fence` first (FencedRunFolder); `folder` itself without one."""
    return folder if fence is None or isinstance(folder, FencedRunFolder) else FencedRunFolder(folder, fence)


def merged_files(folder: RunFolder) -> list[str]:
    """The files of the current merge output: the chunk index and its chunks, or trajectories.pkl."""
    if folder.exists(CHUNK_INDEX_FILE):
        return [CHUNK_INDEX_FILE, *(chunk["name"] for chunk in folder.read_json(CHUNK_INDEX_FILE)["chunks"])]
    return [MERGED_FILE] if folder.exists(MERGED_FILE) else []


def remove_stale_merge_output(folder: RunFolder, keep: set[str]) -> None:
    """Remove the other layout's files and chunks beyond the current count, once the new output
    is complete. An index that is not current goes first: chunk files without one are not an
    output (merged_files ignores them), an index over stale chunks would be."""
    names = folder.list("")
    if CHUNK_INDEX_FILE in names and CHUNK_INDEX_FILE not in keep:
        folder.remove(CHUNK_INDEX_FILE)
    for name in names:
        if (is_chunk_file(name) or name == MERGED_FILE) and name not in keep:
            folder.remove(name)
