"""What tests read from a run folder's shards, through the one reader (ShardCheckpoint.load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder


def _folder(run_dir: str | Path | StorageFolder) -> StorageFolder:
    return run_dir if isinstance(run_dir, StorageFolder) else StorageFolder(str(run_dir))


def shard_checkpoint(run_dir: str | Path | StorageFolder, shard: str = "shard-00000") -> ShardCheckpoint:
    return ShardCheckpoint.load(_folder(run_dir), shard)


def checkpoint_dict(run_dir: str | Path | StorageFolder, shard: str = "shard-00000") -> dict[str, Any]:
    """The shard's folded checkpoint as a dict (parts, completed, failed, lease, ...)."""
    return shard_checkpoint(run_dir, shard).to_dict()


def committed_keys(run_dir: str | Path | StorageFolder, shard: str | None = None) -> list[str]:
    """Sample keys committed in one shard, or in every shard (shard by shard) when `shard` is None."""
    folder = _folder(run_dir)
    shards = [shard] if shard is not None else folder.list("shards")
    return [key for name in shards for key in ShardCheckpoint.load(folder, name).completed]


def has_committed_part(run_dir: str | Path | StorageFolder, shard: str = "shard-00000") -> bool:
    """Whether the shard has a committed part yet (a test waiting for the first commit)."""
    return bool(shard_checkpoint(run_dir, shard).parts)
