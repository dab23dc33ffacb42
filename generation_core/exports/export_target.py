"""Where `genrun export` may write: the output file's folder and name, checked before anything is
read or written.

An export never writes into the run folder it reads (a file there could be one genrun owns, such
as trajectories.pkl or run.json, and the card would land in it too), and never replaces a file
without `--overwrite`: the output file and the files written beside it under names derived from
it (the OpenAI batch error file). The dataset card is not among them: it is merged
(dataset_card.py). The name must end as the format's files do (`.parquet`, `.jsonl`). Every refusal
is one line, before the run's tokenizer loads, with nothing written."""

from __future__ import annotations

import os
from typing import Any

from generation_core.errors import GenrunError
from generation_core.exports.export_options import OUTPUT_SUFFIXES, ExportOptions
from generation_core.store.folder import StorageFolder


def output_location(
    out_url: str,
    run_folder: StorageFolder,
    storage_options: dict[str, Any] | None,
    options: ExportOptions,
    beside: tuple[str, ...] = (),
) -> tuple[StorageFolder, str]:
    """The folder the output goes to (checked writable) and the file name in it, which must end as
    `options.format` writes (OUTPUT_SUFFIXES); an existing file is replaced only with
    `options.overwrite`. `beside`: the names of other files the export writes there, refused like
    the output when they exist."""
    url = str(out_url)
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or url.endswith("/"):
        raise GenrunError(f"output {out_url!r} names a folder; give a file name such as out.parquet")
    if "://" not in url and os.path.isdir(url):
        raise GenrunError(
            f"output {out_url!r} is a directory; give a file name such as {os.path.join(url, 'sft.parquet')}"
        )
    if "://" not in url and parent and os.path.isfile(parent):
        raise GenrunError(f"cannot write {out_url!r}: {parent!r} is a file, not a folder")
    out_folder = StorageFolder(parent if parent else ".", storage_options)
    if is_inside(out_folder, run_folder):
        raise GenrunError(
            f"output {out_url!r} is inside the run folder {run_folder.display()}, whose files genrun owns; "
            "give a path outside it, e.g. beside it"
        )
    file_format = options.format
    suffix = OUTPUT_SUFFIXES[file_format]
    if not name.endswith(suffix) or name == suffix:
        kind = "Parquet" if suffix == ".parquet" else "JSON lines"
        raise GenrunError(
            f"output {out_url!r} does not end in {suffix}, and --format {file_format} writes {kind} there "
            f"(a reader goes by the name): name it e.g. {name.rpartition('.')[0] or name}{suffix}"
        )
    existing = [candidate for candidate in (name, *beside) if out_folder.exists(candidate)]
    if existing and not options.overwrite:
        raise GenrunError(
            f"{out_folder.display(existing[0])} exists; add --overwrite to replace it, or give another output name"
        )
    out_folder.check_writable("OUT")
    return out_folder, name


def is_inside(folder: StorageFolder, run_folder: StorageFolder) -> bool:
    """Whether `folder` is `run_folder` or below it (symbolic links resolved on local disk)."""
    if folder.is_local != run_folder.is_local:
        return False
    if folder.is_local:
        inner, outer = os.path.realpath(folder.root), os.path.realpath(run_folder.root)
        return os.path.commonpath([inner, outer]) == outer
    if folder.fs.protocol != run_folder.fs.protocol:
        return False
    inner, outer = folder.root.rstrip("/"), run_folder.root.rstrip("/")
    return inner == outer or inner.startswith(outer + "/")
