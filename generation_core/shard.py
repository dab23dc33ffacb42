"""Run one shard: resume from its checkpoint, stream trajectories into immutable parts, mark done.

Exactly-once on local disk and S3 alike: a part is written whole under a fresh name, then the
checkpoint that lists it replaces the old one in one atomic put. A part no checkpoint lists is
an orphan from a crash and is never read. `_SUCCESS.json` is written last and says what the
shard holds, so a finished shard is skipped without reading its parts.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import DictConfig
from tqdm import tqdm

from generation_core.data import PromptSet, ShardSpec
from generation_core.records import TrajectoryRecord, records_to_parquet, sample_key_text
from generation_core.storage import RunFolder
from generation_core.streaming import StreamingWorker

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.json"
SUCCESS = "_SUCCESS.json"
# The last attempt's error; `genrun status` reports a shard without a marker but with this file
# as failed. A later successful attempt writes the marker, which takes precedence.
LAST_ERROR = "last_error.json"


@dataclass
class ShardCheckpoint:
    """What a shard has committed: its parts (with checksums) and the samples they hold."""

    parts: list[dict[str, Any]] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
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


async def run_shard(
    cfg: DictConfig, shard: ShardSpec, folder: RunFolder, prompts: PromptSet, worker: StreamingWorker
) -> dict[str, Any]:
    """Generate every missing trajectory of `shard` and return its (small) manifest."""
    if folder.exists(f"shards/{shard.name}/{SUCCESS}"):
        finished = folder.read_json(f"shards/{shard.name}/{SUCCESS}")
        return dict(finished, last_attempt={"trajectories": 0, "generated_tokens": 0, "seconds": 0.0, "skipped": True})
    gen = cfg.generation
    checkpoint = ShardCheckpoint.load(folder, shard)
    checkpoint.attempts += 1
    done = set(checkpoint.completed)
    owed = shard_sample_keys(prompts, shard, cfg.actor_rollout_ref.rollout.n)
    pending = [(key, position) for key, position in owed if sample_key_text(key) not in done]
    logger.info("%s: %d of %d trajectories committed, %d to generate", shard.name, len(done), len(owed), len(pending))

    started = time.perf_counter()
    generated_now = 0
    tokens_now = 0
    writer = _PartWriter(folder, shard, checkpoint)
    progress = tqdm(total=len(owed), initial=len(done), desc=shard.name, disable=not gen.show_progress, unit="traj")
    samples = ((key, prompts.agent_kwargs(position)) for key, position in pending)
    try:
        async for record in worker.stream(samples, gen.max_inflight, idle_timeout=gen.pull_timeout):
            if record is not None:
                writer.add(record)
                generated_now += 1
                tokens_now += sum(record.response_mask)
                progress.update(1)
            if len(writer.buffer) >= gen.save_batch_size or (record is None and writer.buffer) or writer.age() >= gen.pull_timeout:
                writer.commit()
        writer.commit()
    except Exception as exc:
        folder.put_json(
            f"shards/{shard.name}/{LAST_ERROR}",
            {"attempt": checkpoint.attempts, "error": f"{type(exc).__name__}: {exc}", "committed": len(checkpoint.completed), "time": time.time()},
        )
        raise
    finally:
        progress.close()
    elapsed = time.perf_counter() - started
    manifest = {
        "shard": shard.name,
        "shard_id": shard.shard_id,
        "range": [shard.start, shard.end],
        "num_trajectories": len(checkpoint.completed),
        "expected_trajectories": len(owed),
        "response_tokens": checkpoint.response_tokens,
        "generated_tokens": checkpoint.generated_tokens,
        "parts": checkpoint.parts,
        "attempts": checkpoint.attempts,
        "last_attempt": {"trajectories": generated_now, "generated_tokens": tokens_now, "seconds": round(elapsed, 3)},
    }
    if len(set(checkpoint.completed)) != len(owed):
        raise RuntimeError(f"{shard.name}: {len(owed) - len(set(checkpoint.completed))} trajectories missing after the stream ended")
    folder.put_json(f"shards/{shard.name}/{SUCCESS}", manifest)
    return manifest


class _PartWriter:
    """Buffers finished records and commits them as one part + checkpoint."""

    def __init__(self, folder: RunFolder, shard: ShardSpec, checkpoint: ShardCheckpoint):
        self.folder, self.shard, self.checkpoint = folder, shard, checkpoint
        self.buffer: list[TrajectoryRecord] = []
        self.first_buffered_at: float | None = None

    def add(self, record: TrajectoryRecord) -> None:
        if not self.buffer:
            self.first_buffered_at = time.monotonic()
        self.buffer.append(record)

    def age(self) -> float:
        return 0.0 if self.first_buffered_at is None else time.monotonic() - self.first_buffered_at

    def commit(self) -> None:
        if not self.buffer:
            return
        data = records_to_parquet(self.buffer)
        # A fresh name per write: a part from a crashed or concurrent attempt is never overwritten.
        name = f"batch-{len(self.checkpoint.parts):05d}-{uuid.uuid4().hex[:8]}.parquet"
        self.folder.put_atomic(f"shards/{self.shard.name}/{name}", data)
        self.checkpoint.parts.append(
            {"name": name, "count": len(self.buffer), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        )
        self.checkpoint.completed.extend(sample_key_text(r.key) for r in self.buffer)
        self.checkpoint.response_tokens += sum(len(r.response_ids) for r in self.buffer)
        self.checkpoint.generated_tokens += sum(sum(r.response_mask) for r in self.buffer)
        self.checkpoint.save(self.folder, self.shard)
        logger.info("%s: committed %s (%d trajectories, %d in shard)", self.shard.name, name, len(self.buffer), len(self.checkpoint.completed))
        self.buffer = []
        self.first_buffered_at = None
