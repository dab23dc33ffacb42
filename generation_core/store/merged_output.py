"""What a merge left in the run folder, read without loading it: whether the merged output and
trajectories.zip are whole and in the layout the current settings ask for (the finished-run answer,
driver/finished_run.py), the layout rule itself (the merge's, outputs/merge.py), and the
temporary files a merge or zip killed before its rename left at the folder's root. The names are
run_folder.py's."""

from __future__ import annotations

import zipfile
from typing import Any

from generation_core.store.folder import StorageFolder, temporary_target
from generation_core.store.run_folder import (
    CHUNK_INDEX_FILE,
    MANIFEST_FILE,
    MERGED_FILE,
    ZIP_FILE,
    is_chunk_file,
)


def merge_chunk_rows(rows: int, padded_row_bytes: int, chunk_size: int | None, max_file_bytes: int) -> int | None:
    """Rows per chunk file a merge of `rows` trajectories writes: `chunk_size`
    (generation.merge_chunk_size) when set, else chunks of what fits in `max_file_bytes`
    (generation.merge_max_file_bytes) when the whole run does not; None for one trajectories.pkl."""
    if chunk_size:
        return chunk_size
    rows_per_file = max(1, max_file_bytes // padded_row_bytes)
    return rows_per_file if rows > rows_per_file else None


def merged_output_damage(folder: StorageFolder, manifest: dict[str, Any], chunk_rows: int | None) -> str | None:
    """Why the merged output and zip that `manifest` (manifest.json) describes are not on disk as
    a merge in chunks of `chunk_rows` rows (None: one trajectories.pkl) wrote them, or None when
    they are: the layout, each file's size (trajectories.pkl's as manifest.json's `merged_bytes`,
    the chunks' as trajectories.json lists them) against one listing of the folder, and the zip's
    member sizes from its directory. Reads trajectories.json and the zip's directory, no pickle."""
    sizes = folder.list_sizes("")
    if chunk_rows is None:
        if CHUNK_INDEX_FILE in sizes:
            return f"merged in chunks ({CHUNK_INDEX_FILE}), the settings ask for one {MERGED_FILE}"
        if sizes.get(MERGED_FILE) != manifest.get("merged_bytes"):
            return f"{MERGED_FILE} is {sizes.get(MERGED_FILE, 'missing')} bytes, the merge wrote {manifest.get('merged_bytes')}"
        outputs = {MERGED_FILE}
    else:
        try:
            index = folder.read_json(CHUNK_INDEX_FILE) if CHUNK_INDEX_FILE in sizes else None
            chunks = {str(chunk["name"]): chunk["bytes"] for chunk in index["chunks"]} if index else None
        except (ValueError, TypeError, KeyError) as exc:
            return f"{CHUNK_INDEX_FILE} is unreadable ({type(exc).__name__})"
        if index is None or chunks is None:
            return f"not merged in chunks of {chunk_rows} rows ({CHUNK_INDEX_FILE} missing)"
        if index.get("chunk_size") != chunk_rows or index.get("rows") != manifest.get("merged_rows"):
            return f"merged in chunks of {index.get('chunk_size')} rows, the settings ask for {chunk_rows}"
        wrong = [name for name, size in chunks.items() if sizes.get(name) != size]
        if wrong:
            return f"chunk {wrong[0]} is {sizes.get(wrong[0], 'missing')} bytes, {CHUNK_INDEX_FILE} lists {chunks[wrong[0]]}"
        outputs = {CHUNK_INDEX_FILE, *chunks}
    return _zip_damage(folder, sizes, outputs)


def damage_as_merged(folder: StorageFolder) -> str | None:
    """merged_output_damage against the layout on disk (one file, or trajectories.json's chunk
    size), as a reader without the command's settings (`genrun status`) can tell it; None also when
    manifest.json records no merge or predates `merged_bytes`."""
    try:
        manifest = folder.read_json(MANIFEST_FILE)
        index = folder.read_json(CHUNK_INDEX_FILE) if folder.exists(CHUNK_INDEX_FILE) else None
    except (FileNotFoundError, ValueError) as exc:
        return f"{type(exc).__name__} reading {MANIFEST_FILE} or {CHUNK_INDEX_FILE}"
    if (
        not isinstance(manifest, dict)
        or "artifact" not in manifest
        or (index is None and "merged_bytes" not in manifest)
    ):
        return None
    return merged_output_damage(folder, manifest, index.get("chunk_size") if isinstance(index, dict) else None)


def _zip_damage(folder: StorageFolder, sizes: dict[str, int], outputs: set[str]) -> str | None:
    """Why trajectories.zip does not hold `outputs` and its other members at their sizes in the
    folder (`sizes`), from the zip's directory (a cut zip has none); None when it does."""
    if ZIP_FILE not in sizes:
        return f"{ZIP_FILE} is missing"
    try:
        with folder.open_read(ZIP_FILE) as raw, zipfile.ZipFile(raw) as archive:
            members = {info.filename: info.file_size for info in archive.infolist()}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return f"{ZIP_FILE} is unreadable ({type(exc).__name__}: {exc})"
    wrong = sorted(name for name in outputs | set(members) if members.get(name) != sizes.get(name))
    return f"{ZIP_FILE} does not hold {wrong[0]} as it is in the folder" if wrong else None


def remove_leftover_temporaries(folder: StorageFolder) -> None:
    """Remove the temporary files of the merge output, zip and manifest.json that a writer killed
    before its rename (kill -9) left at the folder's root; the caller holds the run's lease, so no
    other writer of these files is running (report.html's, which `genrun report` also writes, stay)."""
    for name in folder.list(""):
        target = temporary_target(name)
        if target in (MERGED_FILE, CHUNK_INDEX_FILE, ZIP_FILE, MANIFEST_FILE) or (target and is_chunk_file(target)):
            folder.remove(name)
