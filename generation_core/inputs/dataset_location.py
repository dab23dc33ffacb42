"""Where the input dataset's files are, and how they are opened.

`data.train_files` entries are local paths (`~` expanded), fsspec URLs (`s3://bucket/key.parquet`),
directories (every `*.parquet` directly inside) and globs (`s3://b/prompts/*.parquet`), each
expanded in sorted order; the entries keep the order they are given in. An entry that exists as
it is names that file or directory, even when its name holds glob characters (`y[1].parquet`).
Remote files are opened with `data.storage_options` (null: `storage.options`, the output's). A
storage or format error of one file becomes the one line a user can act on (`storage_errors`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, cast

import pyarrow as pa
from fsspec.core import url_to_fs
from omegaconf import DictConfig, OmegaConf

from generation_core.config.loading import train_files
from generation_core.errors import GenrunError

HOW_TO_WRITE = "data.train_files takes Parquet (or JSON/JSONL) files in verl's chat layout, e.g. written by pandas' DataFrame.to_parquet"
_GLOB_CHARS = "*?["


def data_storage_options(cfg: DictConfig) -> dict[str, Any]:
    """fsspec options for the input files: data.storage_options, or when null storage.options."""
    options = cfg.data.get("storage_options")
    if options is None:
        options = cfg.storage.options
    return (
        dict(options)
        if isinstance(options, dict)
        else dict(cast(dict[str, Any], OmegaConf.to_container(options, resolve=True)))
    )


def input_filesystem(url: str, options: dict[str, Any]):
    """(filesystem, path) for a URL; remote protocols get the storage options, local paths none."""
    remote = "://" in url and not url.startswith("file://")
    return url_to_fs(url, **(options if remote else {}))


def _is_local(fs) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "file" in protocols


def resolve_train_files(cfg: DictConfig) -> list[str]:
    """Every input file URL, in order: each entry of data.train_files, directories and globs
    expanded and sorted (an entry that exists as it is is no glob)."""
    options = data_storage_options(cfg)
    urls: list[str] = []
    for entry in train_files(cfg):
        entry = str(entry)
        if "://" not in entry:
            entry = os.path.expanduser(entry)
        with storage_errors(entry):
            fs, path = input_filesystem(entry, options)
            # A name that exists as it is is that file (or folder), glob characters or not:
            # `y[1].parquet` is not the pattern that reads `y1.parquet`.
            if any(char in path for char in _GLOB_CHARS) and not fs.exists(path):
                matches = sorted(p for p in fs.glob(path) if not fs.isdir(p))
                if not matches:
                    raise GenrunError(
                        f"data.train_files pattern {entry} matches no file; check the path and the bucket, or list the files"
                    )
            elif fs.isdir(path):
                matches = sorted(p for p in fs.glob(path.rstrip("/") + "/*.parquet") if not fs.isdir(p))
                if not matches:
                    raise GenrunError(
                        f"data file {entry} is a directory with no *.parquet file in it; put the Parquet files there "
                        f"or list the files in data.train_files, e.g. data.train_files=[{entry}/part-0.parquet]"
                    )
            else:
                matches = [path]
        urls.extend(p if _is_local(fs) else fs.unstrip_protocol(p) for p in matches)
    return urls


@contextmanager
def storage_errors(url: str):
    """Storage and format errors of one input file, as the one line a user can act on."""
    try:
        yield
    except GenrunError:
        raise
    except FileNotFoundError:
        raise GenrunError(
            f"data file {url} does not exist (or its bucket does not); set data.train_files to an existing file, directory or pattern"
        ) from None
    except IsADirectoryError:
        raise GenrunError(
            f"data file {url} is a directory, not a file; list the files in it in data.train_files, e.g. data.train_files=[{url}/part-0.parquet]"
        ) from None
    except PermissionError:
        raise GenrunError(
            f"data file {url} is not readable (permission denied); make it readable by this user, copy it to a readable place, "
            "or give credentials in data.storage_options (default: storage.options)"
        ) from None
    except (pa.ArrowInvalid, OSError) as exc:
        kind = url.rsplit(".", 1)[-1]
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GenrunError(f"data file {url} cannot be read as {kind} ({reason}); {HOW_TO_WRITE}") from None


def open_input(url: str, options: dict[str, Any]):
    """A binary file object for an input file (the caller closes it)."""
    fs, path = input_filesystem(url, options)
    return fs.open(path, "rb")
