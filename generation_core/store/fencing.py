"""Fenced writes: the run's lease checked immediately before a write publishes, so a run that
lost its output folder to a later run writes nothing over the new holder's output (the lease
itself: lease.py; the commit log's own fencing by record numbers: commit_log.py)."""

from __future__ import annotations

import contextlib
from typing import Protocol

from generation_core.store.folder import StorageFolder


class Fence(Protocol):
    """The run's lease as writers see it (lease.LeaseFence): `check` raises LeaseLost once a
    later run has taken the folder over."""

    @property
    def generation(self) -> int: ...  # read-only: LeaseFence is frozen

    def check(self, folder: StorageFolder) -> None: ...


class FencedRunFolder(StorageFolder):
    """The run folder as the run's finishing steps write it (merge, manifest.json, zip, report):
    the same storage, with the lease checked immediately before each write publishes (before an
    atomic put, a create, a removal, and at the end of a streamed write, before its file
    appears). A run that lost the folder (LeaseLost) publishes nothing over the new holder's
    output; a streamed file it was writing is discarded."""

    def __init__(self, folder: StorageFolder, fence: Fence):
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


def fenced(folder: StorageFolder, fence: Fence | None) -> StorageFolder:
    """`folder` whose writes check `fence` first (FencedRunFolder); `folder` itself without one."""
    return folder if fence is None or isinstance(folder, FencedRunFolder) else FencedRunFolder(folder, fence)
