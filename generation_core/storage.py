"""RunFolder: the one storage class every component writes through (local disk or s3://).

Commit semantics hold on object stores, which have no rename and no append: every file is
written whole by one `put_atomic`. On a local disk that is a write to a temporary name plus an
atomic rename; on S3 a single PUT of the whole object is already atomic.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from generation_core.errors import GenrunError


class RunFolder:
    """A folder addressed by URL (`/path`, `file://...`, `s3://bucket/prefix`)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = url_to_fs(self.url, **self.storage_options)
        self.is_local = "file" in _protocols(self.fs)

    def __repr__(self) -> str:
        return f"RunFolder({self.url!r})"

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def display(self, relative: str = "") -> str:
        """A location to show users (URL form, never credentials)."""
        return f"{self.url}/{relative}" if relative else self.url

    def exists(self, relative: str) -> bool:
        return self.fs.exists(self.path(relative))

    def read_bytes(self, relative: str) -> bytes:
        with self.fs.open(self.path(relative), "rb") as handle:
            return handle.read()

    def read_json(self, relative: str) -> Any:
        return json.loads(self.read_bytes(relative))

    def put_atomic(self, relative: str, data: bytes) -> None:
        """Write `data` so that readers see either nothing or all of it."""
        target = self.path(relative)
        if self.is_local:
            parent = os.path.dirname(target)
            os.makedirs(parent, exist_ok=True)
            temporary = f"{parent}/.tmp-{uuid.uuid4().hex}-{os.path.basename(target)}"
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        else:
            self.fs.pipe_file(target, data)

    def put_json(self, relative: str, payload: Any) -> None:
        self.put_atomic(relative, json.dumps(payload, indent=2, sort_keys=True, default=str).encode())

    def open_write(self, relative: str):
        """A streaming writer for large outputs (merged pickle, zip); local writes go to a
        temporary name first so a crash never leaves a half file under the real name."""
        target = self.path(relative)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            return _LocalAtomicWriter(target)
        return self.fs.open(target, "wb")

    def list(self, relative: str) -> list[str]:
        """Names (not paths) directly under `relative`; empty when it does not exist."""
        try:
            entries = self.fs.ls(self.path(relative), detail=False)
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(entry.rstrip("/")) for entry in entries)

    def remove(self, relative: str) -> None:
        try:
            self.fs.rm(self.path(relative))
        except FileNotFoundError:
            pass

    def check_writable(self) -> None:
        """Fail early, with the folder named, when the run cannot write its output."""
        probe = f".genrun-write-probe-{uuid.uuid4().hex}"
        try:
            self.put_atomic(probe, b"ok")
            self.remove(probe)
        except (OSError, PermissionError) as exc:
            raise GenrunError(
                f"cannot write to output folder {self.display()}: {exc.__class__.__name__}: {exc}; "
                "choose a writable trainer.default_local_dir"
            ) from None


class _LocalAtomicWriter:
    def __init__(self, target: str):
        self.target = target
        self.temporary = f"{os.path.dirname(target)}/.tmp-{uuid.uuid4().hex}-{os.path.basename(target)}"
        self.handle = open(self.temporary, "wb")

    def write(self, data: bytes) -> int:
        return self.handle.write(data)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            os.replace(self.temporary, self.target)
        else:
            self.handle.close()
            os.remove(self.temporary)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return tuple(protocol) if isinstance(protocol, tuple | list) else (protocol,)
