"""The run folder: every name in it, the typed records its files hold (`PartEntry`,
`SuccessMarker`, the success marker `_SUCCESS.json`), run.json, and the merge output's files.

```
run.json                      resolved config, fingerprint, versions, shard plan (written once)
lease/00000001.json           who holds the folder (lease.py)
shards/shard-00003/
  batch-00000-<uid>.parquet   immutable part: unpadded trajectories
  commits/0000000000.json     numbered commit records, each created exclusively (commit_log.py)
  failures/0000000004.jsonl   samples that failed after retries, with the error: one file per
                              commit record that counts failures, named by its number
  last_error.json             the last failed attempt's error (until the shard finishes)
  _SUCCESS.json               SuccessMarker, written last, after the `done` commit record it names
trajectories.pkl              merged DataProto, or trajectories.json + trajectories-NNNNN.pkl chunks
trajectories.zip              upload artifact
manifest.json                 the run summary
```

Nothing else spells these names. What the commit records say, how they fold into a shard's
state, how writes are fenced and damaged parts repaired is commit_log.py's; this module knows
no record but the names and the shapes.

A folder of any other format (run.json's `fingerprint_version` is not FOLDER_FORMAT) is
refused in one line (`check_run_folder`): finish it with the genrun that wrote it, or start a
new output folder. Nothing reads a format no released genrun wrote.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from generation_core.build import refusal_hint
from generation_core.errors import GenrunError
from generation_core.secrets import without_secrets
from generation_core.store.folder import StorageFolder
from generation_core.store.run_record import RunRecord

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"
LEASE_DIR = "lease"
SHARDS_DIR = "shards"
COMMITS_DIR = "commits"
SUCCESS_FILE = "_SUCCESS.json"
LAST_ERROR_FILE = "last_error.json"
FAILURES_DIR = "failures"
MERGED_FILE = "trajectories.pkl"
CHUNK_INDEX_FILE = "trajectories.json"
CHUNK_FILE_PREFIX = "trajectories-"
ZIP_FILE = "trajectories.zip"
REPORT_FILE = "report.html"


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


# --- records ----------------------------------------------------------------------------------


def record_from_dict(cls, payload: dict[str, Any]):
    """Build a record from JSON, ignoring keys a newer or older writer added."""
    known = {f.name for f in fields(cls)}
    return cls(**{key: value for key, value in payload.items() if key in known})


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
    storage_seconds: float | None = None
    """Seconds spent serializing and writing the part (its commit record not counted), shared
    over its rows as each trajectory's storage time; None in parts of earlier versions."""
    activity: dict[str, Any] | None = None
    """What its trajectories' provenance and time split say they cost (`PartActivity.to_dict`):
    the capacity ledger adds these up instead of reading the trajectories."""


BUSY_SPANS = 16
"""Busy spans a part keeps per replica; beyond, the shortest gaps between them count as busy."""


def busy_spans(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `intervals`, as sorted disjoint spans."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def fewer_spans(spans: list[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    """Sorted disjoint `spans` as at most `most`, joined across their shortest gaps."""
    if len(spans) <= most:
        return spans
    gaps = sorted(range(1, len(spans)), key=lambda i: spans[i][0] - spans[i - 1][1], reverse=True)
    cuts = sorted(gaps[: most - 1])
    starts = [0, *cuts]
    ends = [*(cut - 1 for cut in cuts), len(spans) - 1]
    return [(spans[first][0], spans[last][1]) for first, last in zip(starts, ends, strict=True)]


@dataclass
class PartActivity:
    """The capacity ledger's counters (outputs/ledger.py) for one part, counted from its
    trajectories' provenance and time split as the part is written: per replica (the server
    that answered a turn) its requests, model tokens, busy seconds (the union of its turns) and
    busy spans (Unix seconds, at most BUSY_SPANS); the prefix-cache hits among the turns that
    report one; the time split's totals (TIMINGS); when its first trajectory started."""

    requests: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    busy_seconds: dict[str, float] = field(default_factory=dict)
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    prefix_hits: int = 0
    prefix_reported: int = 0
    time_split: dict[str, float] = field(default_factory=dict)
    started_at: float | None = None

    def add(self, provenance: dict[str, Any] | None, timings: dict[str, float | None] | None) -> None:
        """Count one trajectory (its `provenance` and `timings`, as TrajectoryRecord holds them)."""
        for name, seconds in (timings or {}).items():
            if seconds is not None:
                self.time_split[name] = self.time_split.get(name, 0.0) + seconds
        if provenance is None:
            return
        started_at = float(provenance.get("started_at") or 0.0)
        self.started_at = started_at if self.started_at is None else min(self.started_at, started_at)
        for turn in provenance.get("turns") or []:
            if "prefix_hit" in turn:
                self.prefix_reported += 1
                self.prefix_hits += bool(turn["prefix_hit"])
            replica = turn.get("replica")
            if replica is None:
                continue
            start = started_at + float(turn.get("start") or 0.0)
            self.busy.setdefault(replica, []).append((start, start + float(turn.get("seconds") or 0.0)))
            self.tokens[replica] = self.tokens.get(replica, 0) + int(turn.get("tokens") or 0)
            self.requests[replica] = self.requests.get(replica, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        """The counters as the part's commit record holds them: each replica's turns as its busy
        seconds and at most BUSY_SPANS spans."""
        busy = {replica: busy_spans(turns) for replica, turns in self.busy.items()}
        return dict(
            asdict(self),
            busy_seconds={replica: sum(end - start for start, end in spans) for replica, spans in busy.items()},
            busy={replica: [list(span) for span in fewer_spans(spans, BUSY_SPANS)] for replica, spans in busy.items()},
        )

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> PartActivity:
        activity = record_from_dict(cls, payload)
        activity.busy = {replica: [(start, end) for start, end in spans] for replica, spans in activity.busy.items()}
        return activity


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
class SuccessMarker:
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
    not_owed: int = 0
    """Samples adaptive sampling (generation.adaptive) decided not to draw: prompts whose first
    round decided them owe adaptive_k samples, not n."""
    done_record: int | None = None
    """The number of the shard's `done` commit record this marker belongs to (set as it is written)."""

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> SuccessMarker:
        marker = record_from_dict(cls, payload)
        marker.parts = [record_from_dict(PartEntry, part) for part in payload.get("parts", [])]
        marker.last_attempt = record_from_dict(AttemptStats, payload.get("last_attempt") or {})
        return marker

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_skipped(self) -> SuccessMarker:
        """This marker for an attempt that found the shard finished and did nothing."""
        skipped = SuccessMarker.from_dict(self.to_dict())
        skipped.last_attempt = AttemptStats(skipped=True)
        return skipped

    @property
    def tokens_per_second(self) -> float:
        seconds = self.last_attempt.seconds
        return round(self.last_attempt.generated_tokens / seconds, 2) if seconds else 0.0


def write_last_error(folder: StorageFolder, shard: str, payload: dict[str, Any]) -> None:
    folder.put_json(shard_file(shard, LAST_ERROR_FILE), payload)


def read_last_error(folder: StorageFolder, shard: str) -> dict[str, Any] | None:
    path = shard_file(shard, LAST_ERROR_FILE)
    return folder.read_json(path) if folder.exists(path) else None


# --- run.json ---------------------------------------------------------------------------------


FOLDER_FORMAT = 3
"""The run-folder format and fingerprint recipe (generation_core/preflight/fingerprint.py) that
run.json's `fingerprint_version` names: shard progress as numbered commit records, each finished
shard's `done` record named by its marker. This genrun reads this format only; bump it when
either changes."""


def _genrun_that_wrote(folder: StorageFolder) -> str | None:
    """The genrun version run.json records, if any."""
    try:
        version = RunRecord.from_json(folder.read_json(RUN_FILE)).versions.get("genrun")
    except (FileNotFoundError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return version if isinstance(version, str) and version not in ("", "unknown") else None


def check_run_folder(folder: StorageFolder, run_fingerprint: str) -> RunRecord | None:
    """The folder's run record when it already belongs to this run (a resume), None when it
    holds no run; refuses a folder of another run or of another folder format, changing nothing."""
    start_fresh = (
        "To start fresh, set another trainer.default_local_dir (or trainer.experiment_name, when that folder is "
        "derived from it) or delete that folder"
    )
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
    if existing.fingerprint_version != FOLDER_FORMAT:
        version = _genrun_that_wrote(folder)
        raise GenrunError(
            f"output folder {folder.display()} is in folder format {existing.fingerprint_version} "
            f"({'written by genrun ' + version if version else 'its genrun is not recorded'}); this genrun reads format "
            f"{FOLDER_FORMAT} only. Nothing was changed there. Finish it with that genrun version"
            f"{f' (pip install genrun=={version})' if version else ''}. {start_fresh}"
        )
    if existing.fingerprint == run_fingerprint:
        return existing
    raise GenrunError(
        f"output folder {folder.display()} holds a different run (fingerprint {str(existing.fingerprint)[:12]}, this one is "
        f"{run_fingerprint[:12]}): the config, dataset, user code or versions changed (its config is in "
        f"{folder.display(RUN_FILE)}){refusal_hint(existing.build)}. Nothing was changed there. {start_fresh}"
    )


def claim_run_folder(folder: StorageFolder, run_record: RunRecord) -> None:
    """Write run.json for a new run (the caller holds the lease), or confirm a resume."""
    if check_run_folder(folder, str(run_record.fingerprint)) is None:
        folder.put_json(RUN_FILE, run_record.to_json())


def read_run_record(folder: StorageFolder) -> RunRecord:
    if not folder.exists(RUN_FILE):
        raise GenrunError(f"{folder.display()} is not a genrun run folder (no {RUN_FILE})")
    return RunRecord.from_json(folder.read_json(RUN_FILE))


def config_without_secrets(container: dict[str, Any]) -> dict[str, Any]:
    """The resolved config with every secret masked (generation_core.secrets): run.json, logs
    and trackers never hold credentials."""
    return without_secrets(container)


# --- merged output ------------------------------------------------------------------------------


def merged_files(folder: StorageFolder) -> list[str]:
    """The files of the current merge output: the chunk index and its chunks, or trajectories.pkl."""
    if folder.exists(CHUNK_INDEX_FILE):
        return [CHUNK_INDEX_FILE, *(chunk["name"] for chunk in folder.read_json(CHUNK_INDEX_FILE)["chunks"])]
    return [MERGED_FILE] if folder.exists(MERGED_FILE) else []


def remove_stale_merge_output(folder: StorageFolder, keep: set[str]) -> None:
    """Remove the other layout's files and chunks beyond the current count, once the new output
    is complete. An index that is not current goes first: chunk files without one are not an
    output (merged_files ignores them), an index over stale chunks would be."""
    names = folder.list("")
    if CHUNK_INDEX_FILE in names and CHUNK_INDEX_FILE not in keep:
        folder.remove(CHUNK_INDEX_FILE)
    for name in names:
        if (is_chunk_file(name) or name == MERGED_FILE) and name not in keep:
            folder.remove(name)
