"""StorageFolder: the one storage class every component writes through (local disk or s3://).

Every write is all-or-nothing, on object stores too, which have no rename and no append; a
write that fails publishes nothing and leaves the previous file (or its absence) as it was:
- `put_atomic` writes a file whole: on local disk to a temporary name beside the target, then
  an atomic rename; on S3 one PUT of the whole object (a multipart upload, aborted on failure,
  past 100 MB).
- `open_write` streams large outputs. The target appears when the `with` block ends without an
  exception, never before: on local disk a temporary file renamed at the end; on S3 a multipart
  upload completed at the end and aborted on an exception (s3fs's own file uploads whatever it
  holds when closed, also when the block raised, which would publish a truncated object).
- `create_exclusive` creates a name only if it is free (lease files); `put_if_version` replaces
  a file only if it is still the version the caller read (S3: `If-None-Match: *` / `If-Match`
  on the ETag; local disk: the comparison and the rename under an exclusive flock of the
  directory, against a sha256 of the content). Both are idempotent: when an attempt stored the
  object but its answer was lost, the retry (ours, s3fs's or botocore's, which we cannot see)
  is refused by the condition, and every refusal compares the stored bytes with ours: exactly
  our bytes in place count as success. Callers put a token of their own in the data (a lease's
  owner id, a commit record's random token) so that no one else's object can match. On S3 a
  conditional write is always one PUT (up to S3's 5 GiB limit, refused above it): s3fs's
  multipart upload, past 100 MB, would drop an `If-Match` condition and write unconditionally.

Transient errors (throttling, 5xx, dropped connections, timeouts) are retried with backoff.
They are recognised by the exception's type and, for S3, by botocore's error code and HTTP
status in the error s3fs raises (its `__cause__`), never by words in a message, which may hold
a path such as `shard-00500`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import fsspec
from fsspec.asyn import sync
from fsspec.core import url_to_fs

from generation_core.errors import GenrunError
from generation_core.store.storage_errors import RETRY_DELAYS, is_conflict, is_transient, service_answer

logger = logging.getLogger(__name__)
T = TypeVar("T")

# S3's largest single PUT. A conditional write is sent as one PUT whatever its size: s3fs uploads
# a body past 2 x `chunksize` as a multipart upload and drops the condition on the way.
SINGLE_PUT_LIMIT = 5 * 2**30


class WriteConflict(Exception):
    """A conditional write was refused: the file is not the version the write was based on
    (someone else wrote, created or removed it meanwhile)."""


@dataclass(frozen=True)
class Versioned:
    """A file's content and the version a conditional write names (None, None: no such file)."""

    data: bytes | None
    version: str | None


def encode_json(payload: Any) -> bytes:
    """How every JSON file of a run folder is written."""
    return json.dumps(payload, indent=2, sort_keys=True, default=str).encode()


def content_version(data: bytes) -> str:
    """The version of a local file: a hash of its content (S3's ETag of a single PUT is one too)."""
    return hashlib.sha256(data).hexdigest()


class StorageFolder:
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
                if delay is None or not is_transient(exc):
                    raise
                logger.warning("%s failed (%s: %s); retry %d in %.1f s", what, type(exc).__name__, exc, attempt, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _conditional(self, what: str, relative: str, data: bytes, put: Callable[[], T]) -> tuple[T | None, str | None]:
        """`put` (a conditional write of `data`) with retries of transient errors. Returns
        (put's result, None), or (None, the object's version) when the write was refused because
        an earlier attempt, whose answer was lost, had stored exactly `data` already. Every
        refusal is compared, also that of a first attempt of ours: s3fs and botocore retry a
        request whose connection dropped on their own, and their retry is what was refused."""
        if len(data) >= SINGLE_PUT_LIMIT:
            raise GenrunError(
                f"{what}: {len(data)} bytes is more than one S3 PUT takes (5 GiB), and a multipart upload would drop the "
                "condition that keeps two writers apart; conditional writes are for small records"
            )
        try:
            return self._with_retries(what, put), None
        except (FileExistsError, WriteConflict):
            current = self.read_versioned(relative)
            if current.data == data:
                logger.info("%s: an earlier attempt stored it (its answer was lost)", what)
                return None, current.version
            raise

    def __repr__(self) -> str:
        return f"StorageFolder({self.url!r})"

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

    def read_versioned(self, relative: str) -> Versioned:
        """The file's content and version, read together (one GET on S3), for `put_if_version`."""
        target = self.path(relative)
        try:
            if self.is_local:
                with open(target, "rb") as handle:
                    data = handle.read()
                return Versioned(data, content_version(data))
            data, etag = self._with_retries(
                f"reading {self.display(relative)}", lambda: sync(self.fs.loop, self._get_with_etag, target)
            )
            return Versioned(data, etag)
        except FileNotFoundError:
            return Versioned(None, None)

    async def _get_with_etag(self, target: str) -> tuple[bytes, str]:
        bucket, key, _ = self.fs.split_path(target)
        response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        try:
            return await response["Body"].read(), response["ETag"]
        finally:
            response["Body"].close()

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
        it): a hard link on local disk, a conditional PUT (`If-None-Match: *`) on S3. `data`
        must hold a token of the writer's own: a retry after a lost answer recognises it."""
        target = self.path(relative)
        if self.is_local:
            try:
                self._write_local(relative, data, os.link)
                return True
            except FileExistsError:
                return False
        try:
            # `chunksize`: one PUT below SINGLE_PUT_LIMIT, as in put_if_version.
            self._conditional(
                f"creating {self.display(relative)}",
                relative,
                data,
                lambda: self.fs.pipe_file(target, data, mode="create", chunksize=SINGLE_PUT_LIMIT),
            )
            return True
        except FileExistsError:
            return False

    def put_if_version(self, relative: str, data: bytes, version: str | None) -> str:
        """Replace the file with `data` only if it is still `version` (from `read_versioned` or
        the previous `put_if_version`; None: only if it does not exist). Returns the new
        version; raises WriteConflict when the file changed meanwhile."""
        what = f"writing {self.display(relative)}"
        if self.is_local:
            self._put_local_if_version(relative, data, version)
            return content_version(data)
        target = self.path(relative)
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}

        def put() -> dict[str, Any] | None:
            try:
                # `chunksize`: one PUT below SINGLE_PUT_LIMIT, which keeps the condition.
                return self.fs.pipe_file(target, data, chunksize=SINGLE_PUT_LIMIT, **condition)
            except OSError as exc:
                # If-None-Match on a file that exists (s3fs: FileExistsError), If-Match on one
                # that changed (412) or was removed (NoSuchKey).
                removed = version is not None and isinstance(exc, FileNotFoundError)
                if isinstance(exc, FileExistsError) or removed or is_conflict(exc):
                    raise WriteConflict(f"{self.display(relative)} is not the version this write was based on") from exc
                if (service_answer(exc) or (None, None))[1] == 501:
                    raise GenrunError(
                        f"the object store of {self.url} does not support conditional writes (If-Match on PUT), which "
                        "genrun needs to keep two runs from overwriting each other's checkpoints; use AWS S3 or a store that does"
                    ) from None
                raise

        response, own_version = self._conditional(what, relative, data, put)
        if own_version is not None:
            return own_version
        etag = (response or {}).get("ETag")
        return etag if etag else cast(str, self.read_versioned(relative).version)  # just written: it exists

    def _put_local_if_version(self, relative: str, data: bytes, version: str | None) -> None:
        # Every conditional writer of this directory compares and renames under the same lock.
        target = self.path(relative)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            try:
                with open(target, "rb") as handle:
                    current: str | None = content_version(handle.read())
            except FileNotFoundError:
                current = None
            if current != version:
                raise WriteConflict(f"{self.display(relative)} is not the version this write was based on")
            self._write_local(relative, data, os.replace)
        finally:
            os.close(descriptor)

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
                raise self._full_disk(exc, relative) from exc
            raise
        finally:
            # A full disk fails the write half way: leave no temporary behind to fill it further
            # (after os.replace it is gone already; after os.link it is a second name).
            _remove_quietly(temporary)

    def _full_disk(self, exc: OSError, relative: str) -> OSError:
        return OSError(
            exc.errno,
            f"no space left on the device of {self.display()} (writing {relative}): free space there or choose "
            "another trainer.default_local_dir, then run the same command again; everything committed is kept",
        )

    def put_json(self, relative: str, payload: Any) -> None:
        self.put_atomic(relative, encode_json(payload))

    def open_write(self, relative: str):
        """A streaming writer for large outputs (merged pickle, chunks, zip), used as a context
        manager: the file appears under its name only when the block ends without an exception;
        on an exception the previous file (or its absence) stays as it was."""
        target = self.path(relative)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            return _LocalAtomicWriter(target)
        return _UploadWriter(self.fs, target)

    def open_read(self, relative: str):
        """A streaming reader for large files (the merged output going into the zip)."""
        return self.fs.open(self.path(relative), "rb")

    def local_copy(self, relative: str, scratch_path: str) -> str:
        """A local path holding the file: the file itself on local disk, else a download to
        `scratch_path` (for tools that only take local files, such as W&B's add_file)."""
        if self.is_local:
            return self.path(relative)
        self._with_retries(
            f"downloading {self.display(relative)}", lambda: self.fs.get_file(self.path(relative), scratch_path)
        )
        return scratch_path

    def list(self, relative: str) -> list[str]:
        """Names (not paths) directly under `relative`; empty when it does not exist."""
        try:
            entries = self._with_retries(
                f"listing {self.display(relative)}", lambda: self.fs.ls(self.path(relative), detail=False)
            )
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(entry.rstrip("/")) for entry in entries)

    def list_sizes(self, relative: str) -> dict[str, int]:
        """{name: size in bytes} of the files directly under `relative` (one listing)."""
        try:
            entries = self._with_retries(
                f"listing {self.display(relative)}", lambda: self.fs.ls(self.path(relative), detail=True)
            )
        except FileNotFoundError:
            return {}
        return {
            os.path.basename(entry["name"].rstrip("/")): int(entry.get("size") or 0)
            for entry in entries
            if entry.get("type") != "directory"
        }

    def remove(self, relative: str) -> None:
        try:
            self._with_retries(f"removing {self.display(relative)}", lambda: self.fs.rm(self.path(relative)))
        except FileNotFoundError:
            pass

    def check_writable(self, setting: str = "trainer.default_local_dir") -> None:
        """Fail early, with the folder named, when the run cannot write its output. `setting`: what
        the user gave the folder as, which the refusal says to fix (an export's `OUT`)."""
        probe = f".genrun-write-probe-{uuid.uuid4().hex}"
        try:
            self.put_atomic(probe, b"ok")
            self.remove(probe)
        except Exception as exc:  # noqa: BLE001 - every cause becomes one line naming the folder
            raise GenrunError(self._explain_write_failure(exc, setting)) from None

    def _explain_write_failure(self, exc: Exception, setting: str) -> str:
        name, text = type(exc).__name__, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.is_local:
            blocker = _file_in_the_way(self.root)
            if blocker:
                return f"cannot create output folder {self.display()}: {blocker} is a file, not a folder; choose another {setting}"
            return f"cannot write to output folder {self.display()}: {name}: {text}; choose a writable {setting}"
        bucket = self.root.split("/", 1)[0]
        if name == "NoCredentialsError":
            return (
                f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                "or storage.options.key/secret"
            )
        if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
            return f"bucket {bucket!r} does not exist (output {self.url}); create it or fix {setting}"
        if isinstance(exc, PermissionError):
            return (
                f"bucket {bucket!r} refused the write to {self.url} ({text}): check the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and that they may write to that prefix"
            )
        return (
            f"cannot write to {self.url}: {name}: {text}; check storage.options (endpoint_url, region) and the network"
        )


def _file_in_the_way(path: str) -> str | None:
    """The regular file at `path` or above it that keeps the folder from being created."""
    current = path
    while current and current != os.path.dirname(current):
        if os.path.isfile(current):
            return current
        current = os.path.dirname(current)
    return None


class _LocalAtomicWriter:
    """Writes to a temporary name beside the target; renames it over the target when the `with`
    block succeeds, removes it otherwise (also when finishing the file fails: a full disk)."""

    def __init__(self, target: str):
        self.target = target
        self.temporary = _temporary_name(target)
        self.handle = open(self.temporary, "wb")

    def write(self, data: bytes) -> int:
        return self.handle.write(data)

    def __getattr__(self, name: str):
        # tell/seek/flush/seekable... of the underlying file, for writers such as zipfile.
        if name == "handle":
            raise AttributeError(name)
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.handle.flush()
                os.fsync(self.handle.fileno())
                self.handle.close()
                os.replace(self.temporary, self.target)
            finally:
                self._discard()  # a no-op once renamed
        else:
            self._discard()

    def _discard(self) -> None:
        try:
            self.handle.close()
        except OSError:
            pass  # a full disk fails the last flush too; the file goes either way
        _remove_quietly(self.temporary)


class _UploadWriter:
    """Streams to an object store as a multipart upload that is completed only when the `with`
    block succeeds and aborted otherwise: the object is never seen half written. (s3fs's file
    with autocommit uploads what it holds on close, also when the block raised.)"""

    def __init__(self, fs: fsspec.AbstractFileSystem, target: str):
        # `_open`, not `open`: fsspec's `open` would also enlist the file in a filesystem-wide
        # transaction that nobody ends.
        self.file = fs._open(target, mode="wb", autocommit=False)

    def write(self, data: bytes) -> int:
        return self.file.write(data)

    def __getattr__(self, name: str):
        if name == "file":
            raise AttributeError(name)
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abort()
            return
        try:
            self.file.close()  # uploads the last part
            self.file.commit()  # completes the upload: the object appears, whole
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        try:
            self.file.discard()
        except Exception as exc:  # noqa: BLE001 - the block's own error is the one to report
            logger.warning(
                "could not abort the upload of %s (%s: %s); the bucket's lifecycle rule removes it",
                self.file.path,
                type(exc).__name__,
                exc,
            )
        # Closed without a flush: nothing is uploaded when the file object is collected.
        self.file.closed = True


def _temporary_name(target: str) -> str:
    return f"{os.path.dirname(target)}/.tmp-{uuid.uuid4().hex}-{os.path.basename(target)}"


def temporary_target(name: str) -> str | None:
    """The file name a local write's temporary file `name` (`_temporary_name`) was written for, or
    None when `name` is not one: what a writer killed before its rename left behind."""
    prefix, hex_part, target = name[:5], name[5:37], name[38:]
    if prefix != ".tmp-" or name[37:38] != "-" or not target:
        return None
    return target if all(c in "0123456789abcdef" for c in hex_part) else None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return tuple(protocol) if isinstance(protocol, tuple | list) else (protocol,)
