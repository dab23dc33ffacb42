"""The task cache: what a built task's file is keyed by, and how it is stored and trusted.

A task's rows are shaped by its config, its code and its input files, so the key covers all three:
- code (`task_code_digest`): the source files of the task class and of every class it inherits
  (genrun's Task included), and the local modules its `custom_cls` file imports, transitively,
  found by the same walk as the run fingerprint's user code (`user_code.CodeWalk`);
- input files (`input_files`): every file the dataset reads, by name, size and modification
  time (local) or ETag / last-modified (remote, as fsspec reports them). `path` and `data_dir`
  folders are listed whole, `data_files` globs expanded, all through fsspec, so an edited, added
  or removed file rebuilds. A hub dataset cannot be checked without the network: it is built once
  per `revision` given (its config), and building one logs a line that says so.

A built file is written atomically with a sidecar (`<name>.json`) that holds its sha256 and row
count; a file whose bytes no longer match its sidecar (edited by hand, truncated), or that has
none, is rebuilt from the source.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from generation_core.errors import GenrunError
from generation_core.inputs.user_code import CodeWalk
from generation_core.store.folder import StorageFolder

logger = logging.getLogger(__name__)

_GLOB_CHARS = "*?["
# Keys of fsspec's `info` that change when a file's content does (local, S3, GCS, Azure, HTTP).
_VERSION_KEYS = (
    "size",
    "mtime",
    "ETag",
    "etag",
    "LastModified",
    "last_modified",
    "updated",
    "generation",
    "md5Hash",
    "Content-MD5",
)


def task_code_digest(task_class: type, custom_cls_path: str | None) -> str:
    """The code that builds a task's rows: its class hierarchy's source files and the local
    modules its custom_cls file imports (the fingerprint's code walk)."""
    digest = hashlib.sha256()
    for klass in task_class.__mro__:
        source = getattr(sys.modules.get(klass.__module__), "__file__", None)
        if klass is not object and source and os.path.isfile(source):
            digest.update(Path(source).read_bytes())
    if custom_cls_path:
        walk = CodeWalk()
        walk.add_file(os.path.expanduser(custom_cls_path))
        digest.update(str(walk.found.digest()).encode())
    return digest.hexdigest()


def is_hub_dataset(path: str) -> bool:
    """A `loading_params.path` that names a Hugging Face hub dataset: neither a URL, a local
    path nor one of the builders `datasets` ships (json, parquet, csv, ...)."""
    if "://" in path or os.path.exists(os.path.expanduser(path)):
        return False
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES  # imported only for a name such as `json`

    return path not in _PACKAGED_DATASETS_MODULES


def input_files(where: str, loading_params: dict[str, Any], storage_options: dict[str, Any] | None) -> list[Any]:
    """[url, {size, mtime or ETag...}] of every file a task's dataset reads, and for a hub
    dataset its id and revision. Relative `data_dir` and `data_files` resolve as `datasets`
    resolves them: from a local dataset folder, else from the working directory."""
    path = str(loading_params.get("path"))
    if is_hub_dataset(path):
        return [["hub", path, loading_params.get("revision")]]
    options = dict(loading_params.get("storage_options") or storage_options or {})
    local_path = os.path.expanduser(path)
    entries, base = [], ""
    if "://" in path or os.path.exists(local_path):
        entries.append(path)
        base = local_path if os.path.isdir(local_path) else ""
    data_dir = loading_params.get("data_dir")
    if data_dir:
        base = _joined(base, str(data_dir))
        entries.append(base)
    files = loading_params.get("data_files")
    for pattern in _flattened(list(files.values()) if isinstance(files, dict) else files):
        entries.append(_joined(base, pattern))
    found = []
    for entry in dict.fromkeys(entries):
        try:
            found += [[entry, *matched] for matched in _matches(entry, options)]
        except (OSError, ValueError) as exc:
            raise GenrunError(
                f"{where}.loading_params: cannot list {entry}: {type(exc).__name__}: {exc}".splitlines()[0]
            ) from None
    return found


def _flattened(files: Any) -> list[str]:
    if files is None:
        return []
    if isinstance(files, list | tuple):
        return [name for item in files for name in _flattened(item)]
    return [str(files)]


def _joined(base: str, name: str) -> str:
    name = os.path.expanduser(name)
    if "://" in name or os.path.isabs(name):
        return name
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(os.path.abspath(base or "."), name)


def _matches(entry: str, options: dict[str, Any]) -> list[list[Any]]:
    """(file, its version keys) for each file an entry names: a glob's matches, a folder's files
    (all levels), or the file; nothing when it does not exist (datasets then says so)."""
    remote = "://" in entry and not entry.startswith("file://")
    fs, path = url_to_fs(entry, **(options if remote else {}))
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if any(protocol in ("http", "https") for protocol in protocols):
        infos = {path: fs.info(path)}  # a web server lists no folders; the URL is one file
    elif any(char in path for char in _GLOB_CHARS):
        infos = {}
        for name, info in fs.glob(path, detail=True).items():
            infos.update(fs.find(name, detail=True) if info.get("type") == "directory" else {name: info})
    elif fs.isdir(path):
        infos = fs.find(path, detail=True)
    elif fs.exists(path):
        infos = {path: fs.info(path)}
    else:
        infos = {}
    return [
        [name, {key: str(infos[name][key]) for key in _VERSION_KEYS if key in infos[name]}] for name in sorted(infos)
    ]


def log_hub_build(where: str, loading_params: dict[str, Any]) -> None:
    """One line when a hub dataset is built: genrun will not notice when its content moves on."""
    path = str(loading_params.get("path"))
    if is_hub_dataset(path):
        revision = loading_params.get("revision")
        logger.info(
            "%s: building hub dataset %s at revision %s; it is built once per revision (set loading_params.revision "
            "to a commit to pin it, or to a new one to rebuild)",
            where,
            path,
            revision or "(none given: the latest, read once)",
        )


def cached_parquet(cache: StorageFolder, name: str, build: Callable[[], pa.Table]) -> tuple[bytes, int]:
    """(Parquet bytes, rows) of `name` in the cache, built by `build()` when absent or when its
    bytes do not match its sidecar's sha256 (both written atomically, the file first)."""
    sidecar = f"{name}.json"
    if cache.exists(name):
        data = cache.read_bytes(name)
        try:
            recorded = json.loads(cache.read_bytes(sidecar)) if cache.exists(sidecar) else None
        except ValueError:
            recorded = {}
        if recorded is None:
            logger.warning("task cache: %s has no sha256 record beside it; rebuilding it", cache.display(name))
        elif isinstance(recorded, dict) and recorded.get("sha256") == hashlib.sha256(data).hexdigest():
            return data, pq.ParquetFile(io.BytesIO(data)).metadata.num_rows
        else:
            logger.warning("task cache: %s does not match its recorded sha256; rebuilding it", cache.display(name))
    table = build()
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    cache.put_atomic(name, data)
    cache.put_atomic(sidecar, json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "rows": table.num_rows}).encode())
    return data, table.num_rows
