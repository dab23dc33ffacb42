"""RunFolder: the one storage class every component writes through (local disk or s3://).

Commit semantics hold on object stores, which have no rename and no append: every file is
written whole by one `put_atomic`. On a local disk that is a write to a temporary name plus an
atomic rename; on S3 a single PUT of the whole object is already atomic.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.core import url_to_fs

from generation_core.errors import GenrunError

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Object stores fail transiently (throttling, 5xx, dropped connections); these are retried with
# backoff. Missing objects, refused permissions and programming errors are not.
_PERMANENT_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT_ERRORS):
        return False
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    name = type(exc).__name__
    text = str(exc)
    markers = ("SlowDown", "Throttl", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500", "502", "504", "Connection reset", "EndpointConnectionError")
    return name in ("EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError") or (isinstance(exc, OSError) and any(m in text for m in markers))


class RunFolder:
    """A folder addressed by URL (`/path`, `file://...`, `s3://bucket/prefix`)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        if "://" in self.url and not self.url.startswith("file://"):
            # Other processes write into the same folder: a cached listing would hide their files.
            self.storage_options.setdefault("use_listings_cache", False)
        self.fs, self.root = url_to_fs(self.url, **self.storage_options)
        self.is_local = "file" in _protocols(self.fs)
        self.retry_delays: tuple[float, ...] = () if self.is_local else RETRY_DELAYS

    def _with_retries(self, what: str, operation: Callable[[], T]) -> T:
        for attempt, delay in enumerate((*self.retry_delays, None), start=1):
            try:
                return operation()
            except Exception as exc:  # noqa: BLE001 - classified right below
                if delay is None or not _is_transient(exc):
                    raise
                logger.warning("%s failed (%s: %s); retry %d in %.1f s", what, type(exc).__name__, exc, attempt, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"RunFolder({self.url!r})"

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def display(self, relative: str = "") -> str:
        """A location to show users (URL form, never credentials)."""
        return f"{self.url}/{relative}" if relative else self.url

    def exists(self, relative: str) -> bool:
        return self._with_retries(f"checking {self.display(relative)}", lambda: self.fs.exists(self.path(relative)))

    def read_bytes(self, relative: str) -> bytes:
        return self._with_retries(f"reading {self.display(relative)}", lambda: self.fs.cat_file(self.path(relative)))

    def read_json(self, relative: str) -> Any:
        return json.loads(self.read_bytes(relative))

    def put_atomic(self, relative: str, data: bytes) -> None:
        """Write `data` so that readers see either nothing or all of it."""
        if self.is_local:
            self._write_local(relative, data, os.replace)
        else:
            # One PUT of the whole object: readers see all of it or nothing.
            target = self.path(relative)
            self._with_retries(f"writing {self.display(relative)}", lambda: self.fs.pipe_file(target, data))

    def create_exclusive(self, relative: str, data: bytes) -> bool:
        """Write `data` only if nothing exists under that name; False when something does.
        Of several writers racing for one name exactly one gets True (the run lease relies on
        it): a hard link on local disk, a conditional PUT (`If-None-Match: *`) on S3."""
        target = self.path(relative)
        if self.is_local:
            try:
                self._write_local(relative, data, os.link)
                return True
            except FileExistsError:
                return False
        try:
            self._with_retries(f"creating {self.display(relative)}", lambda: self.fs.pipe_file(target, data, mode="create"))
            return True
        except FileExistsError:
            return False

    def _write_local(self, relative: str, data: bytes, publish: Callable[[str, str], None]) -> None:
        """Write `data` whole to a temporary file beside the target, then `publish` it under the
        target's name (os.replace: atomic overwrite; os.link: fails if the name exists)."""
        target = self.path(relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        temporary = _temporary_name(target)
        try:
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            publish(temporary, target)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(
                    exc.errno,
                    f"no space left on the device of {self.display()} (writing {relative}): free space there or choose "
                    "another trainer.default_local_dir, then run the same command again; everything committed is kept",
                ) from exc
            raise
        finally:
            # A full disk fails the write half way: leave no temporary behind to fill it further
            # (after os.replace it is gone already; after os.link it is a second name).
            _remove_quietly(temporary)

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

    def open_read(self, relative: str):
        """A streaming reader for large files (the merged output going into the zip)."""
        return self.fs.open(self.path(relative), "rb")

    def local_copy(self, relative: str, scratch_path: str) -> str:
        """A local path holding the file: the file itself on local disk, else a download to
        `scratch_path` (for tools that only take local files, such as W&B's add_file)."""
        if self.is_local:
            return self.path(relative)
        self._with_retries(f"downloading {self.display(relative)}", lambda: self.fs.get_file(self.path(relative), scratch_path))
        return scratch_path

    def list(self, relative: str) -> list[str]:
        """Names (not paths) directly under `relative`; empty when it does not exist."""
        try:
            entries = self._with_retries(f"listing {self.display(relative)}", lambda: self.fs.ls(self.path(relative), detail=False))
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(entry.rstrip("/")) for entry in entries)

    def list_sizes(self, relative: str) -> dict[str, int]:
        """{name: size in bytes} of the files directly under `relative` (one listing)."""
        try:
            entries = self._with_retries(f"listing {self.display(relative)}", lambda: self.fs.ls(self.path(relative), detail=True))
        except FileNotFoundError:
            return {}
        return {os.path.basename(entry["name"].rstrip("/")): int(entry.get("size") or 0) for entry in entries if entry.get("type") != "directory"}

    def remove(self, relative: str) -> None:
        try:
            self._with_retries(f"removing {self.display(relative)}", lambda: self.fs.rm(self.path(relative)))
        except FileNotFoundError:
            pass

    def check_writable(self) -> None:
        """Fail early, with the folder named, when the run cannot write its output."""
        probe = f".genrun-write-probe-{uuid.uuid4().hex}"
        try:
            self.put_atomic(probe, b"ok")
            self.remove(probe)
        except Exception as exc:  # noqa: BLE001 - every cause becomes one line naming the folder
            raise GenrunError(self._explain_write_failure(exc)) from None

    def _explain_write_failure(self, exc: Exception) -> str:
        name, text = type(exc).__name__, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.is_local:
            blocker = _file_in_the_way(self.root)
            if blocker:
                return f"cannot create output folder {self.display()}: {blocker} is a file, not a folder; choose another trainer.default_local_dir"
            return f"cannot write to output folder {self.display()}: {name}: {text}; choose a writable trainer.default_local_dir"
        bucket = self.root.split("/", 1)[0]
        if name == "NoCredentialsError":
            return (
                f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                "or storage.options.key/secret"
            )
        if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
            return f"bucket {bucket!r} does not exist (output {self.url}); create it or fix trainer.default_local_dir"
        if isinstance(exc, PermissionError):
            return (
                f"bucket {bucket!r} refused the write to {self.url} ({text}): check the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and that they may write to that prefix"
            )
        return f"cannot write to {self.url}: {name}: {text}; check storage.options (endpoint_url, region) and the network"


def _file_in_the_way(path: str) -> str | None:
    """The regular file at `path` or above it that keeps the folder from being created."""
    current = path
    while current and current != os.path.dirname(current):
        if os.path.isfile(current):
            return current
        current = os.path.dirname(current)
    return None


class _LocalAtomicWriter:
    def __init__(self, target: str):
        self.target = target
        self.temporary = _temporary_name(target)
        self.handle = open(self.temporary, "wb")

    def write(self, data: bytes) -> int:
        return self.handle.write(data)

    def __getattr__(self, name: str):
        # tell/seek/flush/seekable... of the underlying file, for writers such as zipfile.
        return getattr(self.handle, name)

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


def _temporary_name(target: str) -> str:
    return f"{os.path.dirname(target)}/.tmp-{uuid.uuid4().hex}-{os.path.basename(target)}"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return tuple(protocol) if isinstance(protocol, tuple | list) else (protocol,)


SECRET_OPTION_MARKERS = ("key", "secret", "token", "password", "credential")


def redacted_options(options: dict[str, Any]) -> dict[str, Any]:
    """Storage options safe to log or store: anything that looks like a credential is masked,
    also in nested mappings (s3fs passes `client_kwargs` such as aws_secret_access_key to boto)."""
    return {
        name: "<redacted>" if any(m in name.lower() for m in SECRET_OPTION_MARKERS) else redacted_options(value) if isinstance(value, dict) else value
        for name, value in options.items()
    }
