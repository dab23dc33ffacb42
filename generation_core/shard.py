"""Run one shard: resume from its checkpoint, stream trajectories into immutable parts, mark done.

Exactly-once on local disk and S3 alike: a part is written whole under a fresh name, then the
checkpoint that lists it replaces the old one in one atomic put. A part no checkpoint lists is
an orphan from a crash and is never read. `_SUCCESS.json` is written last and says what the
shard holds, so a finished shard is skipped without reading its parts.

A sample whose agent loop still fails after the engine-request retries is never committed: it
is written to `failures.jsonl` (with its error) and the shard carries on. Once the stream ends,
the shard fails if more than `generation.max_failed_fraction` of its trajectories failed;
otherwise its marker counts the failures. Failed samples are pending for every later attempt
or run, which regenerates exactly them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import resource
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import DictConfig
from tqdm import tqdm

from generation_core.data import PromptSet, ShardSpec
from generation_core.failpoints import failpoint
from generation_core.lease import LeaseFence
from generation_core.records import SampleFailure, TrajectoryRecord, records_to_parquet, sample_key_text, to_json
from generation_core.storage import RunFolder
from generation_core.streaming import StreamingWorker
from generation_core.timeline import mark

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.json"
SUCCESS = "_SUCCESS.json"
# The last attempt's error; `genrun status` reports a shard without a marker but with this file
# as failed. A later successful attempt writes the marker, which takes precedence.
LAST_ERROR = "last_error.json"
FAILURES = "failures.jsonl"


class TooManyFailedSamples(RuntimeError):
    """More samples of a shard failed than generation.max_failed_fraction allows."""


@dataclass
class ShardCheckpoint:
    """What a shard has committed: its parts (with checksums) and the samples they hold."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    repaired_parts: list[dict[str, Any]] = field(default_factory=list)
    """Committed parts found damaged and dropped (their samples were generated again)."""
    failed: list[str] = field(default_factory=list)
    """Samples that failed in the latest attempt (never committed; pending for the next one)."""
    response_tokens: int = 0
    generated_tokens: int = 0
    attempts: int = 0

    @classmethod
    def load(cls, folder: RunFolder, shard: ShardSpec) -> "ShardCheckpoint":
        path = f"shards/{shard.name}/{CHECKPOINT}"
        if not folder.exists(path):
            return cls()
        return cls(**folder.read_json(path))

    def save(self, folder: RunFolder, shard: ShardSpec) -> None:
        folder.put_json(f"shards/{shard.name}/{CHECKPOINT}", asdict(self))


def shard_sample_keys(prompts: PromptSet, shard: ShardSpec, n: int) -> list[tuple[tuple[int, int], int]]:
    """(sample key, dataset position) for every trajectory the shard owes, in dataset order."""
    keys = []
    for position in range(shard.start, shard.end):
        keys.extend(((prompts.sample_index(position), rollout_n), position) for rollout_n in range(n))
    return keys


def allowed_failures(owed: int, max_failed_fraction: float) -> int:
    return int(owed * max_failed_fraction + 1e-9)


def finished_marker(folder: RunFolder, shard: ShardSpec) -> dict[str, Any] | None:
    """The shard's success marker when there is nothing left to do for it: none of its samples
    failed. A marker that records failures means a later run regenerates those samples."""
    path = f"shards/{shard.name}/{SUCCESS}"
    if not folder.exists(path):
        return None
    marker = folder.read_json(path)
    return None if marker.get("failures", 0) else marker


def skipped_attempt(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a shard that had nothing left to do: this attempt generated nothing."""
    return dict(manifest, last_attempt={"trajectories": 0, "generated_tokens": 0, "seconds": 0.0, "skipped": True})


async def run_shard(
    cfg: DictConfig, shard: ShardSpec, folder: RunFolder, prompts: PromptSet, worker: StreamingWorker, fence: LeaseFence | None = None
) -> dict[str, Any]:
    """Generate every missing trajectory of `shard` and return its (small) manifest. With a
    `fence` (the run's lease), every commit first checks that no later run took the folder."""
    from generation_core.part_integrity import repair_shard

    # A damaged committed part (truncated, corrupted, gone) is dropped here and its samples
    # are generated again below; the repair is recorded in the checkpoint and the marker.
    repair_shard(folder, shard.name)
    finished = finished_marker(folder, shard)
    if finished is not None:
        return skipped_attempt(finished)
    gen = cfg.generation
    checkpoint = ShardCheckpoint.load(folder, shard)
    checkpoint.attempts += 1
    # Failed samples of earlier attempts are pending again.
    checkpoint.failed = []
    done = set(checkpoint.completed)
    owed = shard_sample_keys(prompts, shard, cfg.actor_rollout_ref.rollout.n)
    pending = [(key, position) for key, position in owed if sample_key_text(key) not in done]
    logger.info("%s: %d of %d trajectories committed, %d to generate", shard.name, len(done), len(owed), len(pending))

    started = time.perf_counter()
    postprocess_before = worker.postprocess_seconds
    engine_before = engine_counters(worker)
    generated_now = 0
    tokens_now = 0
    writer = _PartWriter(folder, shard, checkpoint, fence)
    allowed = allowed_failures(len(owed), gen.max_failed_fraction)
    # Many failures past the allowance mean something systematic (engine down, broken loop):
    # stop after committing what succeeded rather than fail every remaining sample slowly.
    give_up_after = allowed + 2 * gen.max_inflight
    progress = tqdm(total=len(owed), initial=len(done), desc=shard.name, disable=not gen.show_progress, unit="traj")
    samples = ((key, prompts.agent_kwargs(position)) for key, position in pending)
    stream = worker.stream(samples, gen.max_inflight, idle_timeout=gen.pull_timeout)
    try:
        async for record in stream:
            if isinstance(record, SampleFailure):
                writer.add_failure(record)
                if writer.failures_this_attempt() >= give_up_after:
                    break
            elif record is not None:
                writer.add(record)
                generated_now += 1
                tokens_now += sum(record.response_mask)
                progress.update(1)
            if len(writer.buffer) >= gen.save_batch_size or (record is None and writer.has_uncommitted()) or writer.age() >= gen.pull_timeout:
                # In a thread: samples in flight keep talking to the engine while a part is
                # written (an S3 put takes tens of milliseconds).
                await asyncio.to_thread(writer.commit)
        await asyncio.to_thread(writer.commit)
        if len(checkpoint.failed) > allowed:
            raise TooManyFailedSamples(
                f"{shard.name}: {len(checkpoint.failed)} of {len(owed)} trajectories failed, more than "
                f"generation.max_failed_fraction={gen.max_failed_fraction} allows "
                f"({allowed}); errors in {folder.display(f'shards/{shard.name}/{FAILURES}')}. "
                "The next attempt regenerates only the failed and missing samples"
            )
    except Exception as exc:
        try:
            folder.put_json(
                f"shards/{shard.name}/{LAST_ERROR}",
                {"attempt": checkpoint.attempts, "error": f"{type(exc).__name__}: {exc}", "committed": len(checkpoint.completed), "time": time.time()},
            )
        except Exception as write_error:  # noqa: BLE001 - storage may be what failed (disk full): keep the first error
            logger.warning("%s: could not record the error in %s (%s)", shard.name, LAST_ERROR, write_error)
        raise
    finally:
        # Cancels what is still in flight (after a give-up or an error) before we return.
        await stream.aclose()
        progress.close()
    elapsed = time.perf_counter() - started
    manifest = {
        "shard": shard.name,
        "shard_id": shard.shard_id,
        "range": [shard.start, shard.end],
        "num_trajectories": len(checkpoint.completed),
        "expected_trajectories": len(owed),
        "failures": len(checkpoint.failed),
        "failed_samples": list(checkpoint.failed),
        "response_tokens": checkpoint.response_tokens,
        "generated_tokens": checkpoint.generated_tokens,
        "parts": checkpoint.parts,
        "repaired_parts": checkpoint.repaired_parts,
        "attempts": checkpoint.attempts,
        "last_attempt": {
            "trajectories": generated_now,
            "generated_tokens": tokens_now,
            "seconds": round(elapsed, 3),
            # Where the shard's time went, for the orchestration benchmark and for users asking
            # why a shard is slow: seconds inside each stage (storage runs beside generation).
            "stage_seconds": {stage: round(seconds, 3) for stage, seconds in writer.stage_seconds.items()} | {"postprocess": round(worker.postprocess_seconds - postprocess_before, 3)},
            # Engine requests resent after a transient error, and replica failures failed over.
            "engine": {name: count - engine_before[name] for name, count in engine_counters(worker).items()},
            # Peak resident memory of the process that ran the shard (a Ray worker in a flow run).
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
    }
    missing = len(owed) - len(set(checkpoint.completed)) - len(set(checkpoint.failed))
    if missing:
        raise RuntimeError(f"{shard.name}: {missing} trajectories neither committed nor failed after the stream ended")
    folder.put_json(f"shards/{shard.name}/{SUCCESS}", manifest)
    return manifest


def engine_counters(worker: StreamingWorker) -> dict[str, int]:
    """Counters of the worker's engine client (RetryingClient around LocalRoutingClient)."""
    client = getattr(worker, "client", None)
    stats = getattr(client, "stats", None)
    return {
        "requests": getattr(stats, "requests", 0),
        "request_retries": getattr(stats, "retries", 0),
        "replica_failures": getattr(getattr(client, "client", None), "replica_failures", 0),
    }


class _PartWriter:
    """Buffers finished records and commits them as one part + checkpoint."""

    def __init__(self, folder: RunFolder, shard: ShardSpec, checkpoint: ShardCheckpoint, fence: LeaseFence | None = None):
        self.folder, self.shard, self.checkpoint, self.fence = folder, shard, checkpoint, fence
        self.buffer: list[TrajectoryRecord] = []
        self.new_failures: list[SampleFailure] = []
        self.first_buffered_at: float | None = None
        self.stage_seconds = {"serialization": 0.0, "storage": 0.0}
        failures_path = f"shards/{shard.name}/{FAILURES}"
        # Every failure of every attempt, kept whole: S3 cannot append, so the file is rewritten.
        self.failure_log = folder.read_bytes(failures_path).decode() if folder.exists(failures_path) else ""

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
                mark(f"first_part_written {self.shard.shard_id}")
            mark(f"part_written {self.shard.shard_id}")
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
        self.folder.put_atomic(f"shards/{self.shard.name}/{FAILURES}", self.failure_log.encode())
        self.checkpoint.failed.extend(sample_key_text(f.key) for f in self.new_failures)
        logger.warning("%s: %d sample(s) failed, recorded in %s", self.shard.name, len(self.new_failures), FAILURES)

    def _write_part(self) -> None:
        started = time.perf_counter()
        data = records_to_parquet(self.buffer)
        serialized = time.perf_counter()
        self.stage_seconds["serialization"] += serialized - started
        # A fresh name per write: a part from a crashed or concurrent attempt is never overwritten.
        name = f"batch-{len(self.checkpoint.parts):05d}-{uuid.uuid4().hex[:8]}.parquet"
        failpoint("before_part_write")
        self.folder.put_atomic(f"shards/{self.shard.name}/{name}", data)
        self.stage_seconds["storage"] += time.perf_counter() - serialized
        response_tokens = sum(len(r.response_ids) for r in self.buffer)
        generated_tokens = sum(sum(r.response_mask) for r in self.buffer)
        self.checkpoint.parts.append(
            {
                "name": name,
                "count": len(self.buffer),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                # Per part, so dropping a damaged part keeps the shard's totals right.
                "response_tokens": response_tokens,
                "generated_tokens": generated_tokens,
            }
        )
        self.checkpoint.completed.extend(sample_key_text(r.key) for r in self.buffer)
        self.checkpoint.response_tokens += response_tokens
        self.checkpoint.generated_tokens += generated_tokens
        logger.info("%s: committed %s (%d trajectories, %d in shard)", self.shard.name, name, len(self.buffer), len(self.checkpoint.completed))
