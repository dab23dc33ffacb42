"""The run folder: every name in it, its typed records, and the one verifier of committed parts.

```
run.json                      resolved config, fingerprint, versions, shard plan (written once)
lease/00000001.json           who holds the folder (lease.py)
shards/shard-00003/
  batch-00000-<uid>.parquet   immutable part: unpadded trajectories
  checkpoint.json             ShardCheckpoint: the committed parts (one atomic put per commit)
  failures.jsonl              samples that failed after retries, with the error
  last_error.json             the last failed attempt's error (until the shard finishes)
  _SUCCESS.json               ShardManifest, written last
trajectories.pkl              merged DataProto, or trajectories.json + trajectories-NNNNN.pkl chunks
trajectories.zip              upload artifact
manifest.json                 the run summary
```

Nothing else spells these names. A part no checkpoint lists is an orphan of a crash and is never
read. Under a run lease, every checkpoint write is fenced (`ShardCheckpoint.save` with the run's
`LeaseFence`): conditional on the version it was read as, after the shard was claimed for the
lease; part_writer.py says why that closes the window a plain "check, then write" leaves.

A committed part can still be damaged later (a truncated copy, a bad disk, someone editing the
bucket): `repair_shard` finds it against its checkpoint's size and sha256, drops it (its samples
are pending again) and records the repair, so a loss is reported, never silent; the damaged
file stays where it is, listed by no checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from generation_core.errors import GenrunError
from generation_core.storage import RunFolder, WriteConflict, encode_json, redacted_options

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"
LEASE_DIR = "lease"
SHARDS_DIR = "shards"
CHECKPOINT_FILE = "checkpoint.json"
SUCCESS_FILE = "_SUCCESS.json"
LAST_ERROR_FILE = "last_error.json"
FAILURES_FILE = "failures.jsonl"
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

    generation: int

    def check(self, folder: RunFolder) -> None: ...


class CheckpointConflict(RuntimeError):
    """A fenced write found the file changed by another writer while this run still holds the
    folder (two writers of one shard in one run); the shard's next attempt resumes from it."""


# Conditional writes that lose a race read again and retry this often before giving up.
_CONFLICT_RETRIES = 5


def _from_dict(cls, payload: dict[str, Any]):
    """Build a record from JSON, ignoring keys a newer or older writer added."""
    known = {f.name for f in fields(cls)}
    return cls(**{key: value for key, value in payload.items() if key in known})


# --- records ----------------------------------------------------------------------------------


@dataclass
class PartEntry:
    """One committed part, as its checkpoint lists it."""

    name: str
    count: int
    """Trajectories in the part."""
    bytes: int
    sha256: str
    response_tokens: int | None = None
    """Response tokens of its trajectories (tool tokens included); None in parts of early versions."""
    generated_tokens: int | None = None
    """Model tokens (response_mask) of its trajectories."""


@dataclass
class ShardCheckpoint:
    """What a shard has committed: its parts (with checksums) and the samples they hold."""

    parts: list[PartEntry] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    """Sample keys ("index:rollout_n") in commit order, part after part."""
    repaired_parts: list[dict[str, Any]] = field(default_factory=list)
    """Committed parts found damaged and dropped (their samples were generated again)."""
    failed: list[str] = field(default_factory=list)
    """Samples that failed in the latest attempt (never committed; pending for the next one)."""
    response_tokens: int = 0
    generated_tokens: int = 0
    attempts: int = 0
    lease: int | None = None
    """Generation of the run lease it was last written under (None: written without a lease)."""

    def __post_init__(self) -> None:
        # The stored version (S3 ETag, a content hash on local disk) it was read or last written
        # as: a fenced save is conditional on it. Not part of the record.
        self.version: str | None = None

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> "ShardCheckpoint":
        checkpoint = _from_dict(cls, payload)
        checkpoint.parts = [_from_dict(PartEntry, part) for part in payload.get("parts", [])]
        return checkpoint

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, folder: RunFolder, shard: str, fence: Fence | None = None) -> "ShardCheckpoint":
        """The shard's checkpoint (empty when it has none). With `fence`, the run that is about
        to generate into the shard first claims it: the checkpoint is rewritten under its lease,
        so a commit that an earlier holder still has in flight finds it changed and is refused."""
        path = shard_file(shard, CHECKPOINT_FILE)
        for _ in range(_CONFLICT_RETRIES):
            stored = folder.read_versioned(path)
            checkpoint = cls.from_dict(json.loads(stored.data)) if stored.data is not None else cls()
            checkpoint.version = stored.version
            if fence is None or not checkpoint._needs_claim(fence):
                return checkpoint
            try:
                checkpoint.save(folder, shard, fence)
                return checkpoint
            except CheckpointConflict:
                continue  # the earlier holder's last commit landed first: read it, claim again
        raise CheckpointConflict(f"could not claim {folder.display(path)}: it kept changing under this run")

    def _needs_claim(self, fence: Fence) -> bool:
        if self.lease == fence.generation:
            return False
        # Lease 1 is the folder's first: no earlier run can have a commit in flight, and a shard
        # keeps having no checkpoint until its first part is committed.
        return self.version is not None or fence.generation > 1

    def save(self, folder: RunFolder, shard: str, fence: Fence | None = None) -> None:
        """Write the checkpoint. Without a fence: one atomic put (library use, tests). With the
        run's lease fence: only while the run holds the folder and only over the version this
        checkpoint was read or last written as; a run that lost the lease raises LeaseLost
        (from `fence.check`) and writes nothing."""
        path = shard_file(shard, CHECKPOINT_FILE)
        if fence is None:
            folder.put_json(path, self.to_dict())
            return
        fence.check(folder)
        if self.lease is not None and self.lease > fence.generation:
            # Read after a later run claimed it: never written back under an older lease.
            raise CheckpointConflict(f"{folder.display(path)} belongs to a later run (lease {self.lease}); this run (lease {fence.generation}) stops")
        previous_lease, self.lease = self.lease, fence.generation
        try:
            self.version = folder.put_if_version(path, encode_json(self.to_dict()), self.version)
        except WriteConflict:
            self.lease = previous_lease
            # Changed since we read it: a later run claimed the shard (LeaseLost), or else a
            # second writer of this run did.
            fence.check(folder)
            raise CheckpointConflict(
                f"{folder.display(path)} was changed by another writer while this run (lease {fence.generation}) still "
                "holds the folder; this attempt stops, the next one resumes from the checkpoint"
            ) from None


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

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> "ShardManifest":
        manifest = _from_dict(cls, payload)
        manifest.parts = [_from_dict(PartEntry, part) for part in payload.get("parts", [])]
        manifest.last_attempt = _from_dict(AttemptStats, payload.get("last_attempt") or {})
        return manifest

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_skipped(self) -> "ShardManifest":
        """This manifest for an attempt that found the shard finished and did nothing."""
        skipped = ShardManifest.from_dict(self.to_dict())
        skipped.last_attempt = AttemptStats(skipped=True)
        return skipped

    @property
    def tokens_per_second(self) -> float:
        seconds = self.last_attempt.seconds
        return round(self.last_attempt.generated_tokens / seconds, 2) if seconds else 0.0


def read_marker(folder: RunFolder, shard: str) -> ShardManifest | None:
    path = shard_file(shard, SUCCESS_FILE)
    return ShardManifest.from_dict(folder.read_json(path)) if folder.exists(path) else None


def write_marker(folder: RunFolder, manifest: ShardManifest, fence: Fence | None = None) -> None:
    """The shard's success marker, written last. With `fence`, not by a run that lost the folder
    (its last commit was refused already; this covers a takeover right after it)."""
    if fence is not None:
        fence.check(folder)
    folder.put_json(shard_file(manifest.shard, SUCCESS_FILE), manifest.to_dict())


def write_last_error(folder: RunFolder, shard: str, payload: dict[str, Any]) -> None:
    folder.put_json(shard_file(shard, LAST_ERROR_FILE), payload)


def read_last_error(folder: RunFolder, shard: str) -> dict[str, Any] | None:
    path = shard_file(shard, LAST_ERROR_FILE)
    return folder.read_json(path) if folder.exists(path) else None


def append_failure_log(folder: RunFolder, shard: str, lines: str, fence: Fence | None = None) -> None:
    """Add `lines` to the shard's failure log, which keeps every failure of every attempt. S3
    cannot append: the file is read and rewritten whole. With a fence the rewrite is
    conditional on the version read (lines another writer added meanwhile are never dropped)
    and a run that lost the lease writes nothing."""
    path = shard_file(shard, FAILURES_FILE)
    for _ in range(_CONFLICT_RETRIES):
        if fence is not None:
            fence.check(folder)
        stored = folder.read_versioned(path)
        text = (stored.data or b"") + lines.encode()
        if fence is None:
            folder.put_atomic(path, text)
            return
        try:
            folder.put_if_version(path, text, stored.version)
            return
        except WriteConflict:
            continue
    raise CheckpointConflict(f"could not add to {folder.display(path)}: it kept changing under this run")


# --- run.json ---------------------------------------------------------------------------------


FINGERPRINT_VERSION = 2
"""The recipe of the run fingerprint (config.fingerprint) that run.json's `fingerprint_version`
names; a run.json without one was written by recipe 1. Bump it when the recipe changes, and say
in FINGERPRINT_ADDED what the new recipe covers."""
FINGERPRINT_ADDED = {
    2: "engine_kwargs (e.g. instant.response_tokens, hf.dtype, hf.ignore_eos, remote.model), the model's files, "
    "the agent-loop YAML and its classes' source, the tool config",
}


def check_run_folder(folder: RunFolder, run_fingerprint: str) -> bool:
    """True when the folder already belongs to this run (a resume), False when it holds no run;
    refuses a folder of another run, changing nothing."""
    if not folder.exists(RUN_FILE):
        return False
    existing = folder.read_json(RUN_FILE)
    if existing.get("fingerprint") == run_fingerprint:
        return True
    written_by = existing.get("fingerprint_version", 1)
    if written_by == FINGERPRINT_VERSION:
        what = (
            f"holds a different run (fingerprint {str(existing.get('fingerprint'))[:12]}, this one is {run_fingerprint[:12]}): "
            f"the config, dataset or versions changed (its config is in {folder.display(RUN_FILE)}). Nothing was changed there."
        )
    else:
        # Another recipe computed its fingerprint: it differs even when the run is the same.
        if isinstance(written_by, int) and written_by < FINGERPRINT_VERSION:
            uncovered = "; ".join(FINGERPRINT_ADDED.get(v, f"recipe {v}'s inputs") for v in range(written_by + 1, FINGERPRINT_VERSION + 1))
            writer = f"an earlier genrun whose fingerprint did not cover {uncovered}"
        else:
            writer = "a genrun with another fingerprint recipe"
        what = (
            f"holds a different run or the same run written by {writer} (fingerprint version {written_by!r}, this "
            f"genrun's is {FINGERPRINT_VERSION}). Nothing was changed there. Finish it with that genrun version."
        )
    raise GenrunError(
        f"output folder {folder.display()} {what} To start fresh, set another trainer.default_local_dir "
        "(or trainer.experiment_name, when that folder is derived from it) or delete that folder"
    )


def claim_run_folder(folder: RunFolder, run_record: dict[str, Any]) -> None:
    """Write run.json for a new run (the caller holds the lease), or confirm a resume."""
    if not check_run_folder(folder, run_record["fingerprint"]):
        folder.put_json(RUN_FILE, run_record)


def read_run_record(folder: RunFolder) -> dict[str, Any]:
    if not folder.exists(RUN_FILE):
        raise GenrunError(f"{folder.display()} is not a genrun run folder (no {RUN_FILE})")
    return folder.read_json(RUN_FILE)


def config_without_secrets(container: dict[str, Any]) -> dict[str, Any]:
    """The resolved config with storage options and remote-server settings masked: run.json,
    logs and trackers never hold credentials."""
    container = json.loads(json.dumps(container))
    container["storage"]["options"] = redacted_options(container["storage"]["options"])
    engine_kwargs = container["actor_rollout_ref"]["rollout"]["engine_kwargs"]
    engine_kwargs["remote"] = redacted_options(engine_kwargs.get("remote") or {})
    return container


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
    parts = []
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
    """The checkpoint without the damaged parts and their samples (pending again), with the
    repairs recorded; written back, and the shard's success marker removed. With `fence`, only
    while the run holds the folder, over the version `checkpoint` was read as."""
    if sum(p.count for p in checkpoint.parts) != len(checkpoint.completed):
        raise GenrunError(
            f"cannot repair {shard_file(shard)}: its checkpoint's part counts do not add up to its completed samples; "
            f"delete {folder.display(shard_file(shard))} to regenerate the whole shard"
        )
    kept, completed, repaired = [], [], list(checkpoint.repaired_parts)
    offset = 0
    for part in checkpoint.parts:
        samples = checkpoint.completed[offset : offset + part.count]
        offset += part.count
        if part.name in reasons:
            repaired.append({"name": part.name, "reason": reasons[part.name], "samples": len(samples), "time": round(time.time(), 3)})
            logger.warning(
                "%s is damaged (%s): dropped from the checkpoint, its %d samples will be regenerated",
                shard_file(shard, part.name), reasons[part.name], len(samples),
            )
        else:
            kept.append(part)
            completed.extend(samples)
    repaired_checkpoint = ShardCheckpoint.from_dict(checkpoint.to_dict())
    repaired_checkpoint.version = checkpoint.version
    repaired_checkpoint.parts, repaired_checkpoint.completed, repaired_checkpoint.repaired_parts = kept, completed, repaired
    # Token totals from the parts that remain (parts of early versions carry no counts: their
    # totals stay as they were, an overcount rather than a wrong sum).
    if all(p.response_tokens is not None for p in kept):
        repaired_checkpoint.response_tokens = sum(p.response_tokens for p in kept)
        repaired_checkpoint.generated_tokens = sum(p.generated_tokens for p in kept)
    # Marker first: a crash between the two leaves an unfinished shard whose next attempt
    # finds the same damage again. A run that lost its lease stops before either.
    if fence is not None:
        fence.check(folder)
    folder.remove(shard_file(shard, SUCCESS_FILE))
    repaired_checkpoint.save(folder, shard, fence)
    return repaired_checkpoint


def repair_shard(folder: RunFolder, shard: str, *, size_only: bool = False, fence: Fence | None = None) -> int:
    """Verify a shard's committed parts and drop the damaged ones; returns how many were dropped.
    `size_only`: one listing, no reads (catches missing and truncated parts; a same-size
    corruption needs the full check). `fence`: the run's lease, when the caller holds one."""
    if not folder.exists(shard_file(shard, CHECKPOINT_FILE)):
        return 0
    checkpoint = ShardCheckpoint.load(folder, shard)
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
