"""Parts -> the verl DataProto training consumes, padded exactly as verl's agent loop pads it
(padding.py). `merge_output` is the entry point: it reads every shard's
committed parts (checksums verified), orders them by (index, rollout_n) and writes either
`trajectories.pkl` (`merge_run`), which `DataProto.load_from_disk` reads, or, with a chunk size,
the same rows as `trajectories-00000.pkl, ...` of at most `chunk_size` rows plus
`trajectories.json` listing them (`merge_run_chunked`), for runs whose DataProto does not fit in
memory.

Memory: a merge holds the padded tensors of one output file plus one part. Token lists go from
Arrow straight into the padded tensors (no Python list per token), and the pickle is written
by `dump_dataproto` (dataproto_pickle.py) without the copies verl's `DataProto.__getstate__` makes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from verl.protocol import DataProto

from generation_core.config.settings import GenerationSettings
from generation_core.errors import GenrunError
from generation_core.outputs.dataproto_pickle import dump_dataproto
from generation_core.outputs.padding import BatchLayout, ImageMerge, PaddedBatchBuilder, Padding, padded_row_bytes
from generation_core.store.folder import StorageFolder
from generation_core.store.merged_output import merge_chunk_rows, remove_leftover_temporaries
from generation_core.store.part_repair import CommittedPartRef, committed_parts, read_verified_part
from generation_core.store.run_folder import (
    CHUNK_INDEX_FILE,
    MERGED_FILE,
    SuccessMarker,
    chunk_file_name,
    read_run_record,
    remove_stale_merge_output,
)
from generation_core.store.trajectory_record import (
    OPTIONAL_COLUMNS,
    SHARED_RAW_PROMPT,
    TOKEN_COLUMNS,
    decode_fields,
    decode_images,
    decode_provenance,
    read_part_table,
    scored_mask,
)

logger = logging.getLogger(__name__)

# Keys verl's _postprocess always emits among the non-tensor fields, present or not.
_DEFAULT_EXTRA_KEYS = {"turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras"}


def check_shard_counts(markers: list[SuccessMarker], rollout_n: int, adaptive: bool = False) -> None:
    """Refuse to merge a run a shard of which does not account for every trajectory its range
    owes: committed + failed + filtered (overlong rows x n) + not owed (what adaptive sampling,
    on in the run's config, decided not to draw) must equal its rows x n. A shard
    that read fewer rows than planned (an input file cut or replaced under it) would otherwise
    be merged as complete, with trajectories missing."""
    for marker in markers:
        start, end = marker.range
        planned = (end - start) * rollout_n
        filtered = marker.filtered_overlong * rollout_n
        not_owed = marker.not_owed if adaptive else 0
        accounted = marker.num_trajectories + marker.failures + filtered + not_owed
        if accounted != planned:
            raise GenrunError(
                f"{marker.shard} accounts for {accounted} of the {planned} trajectories of its rows [{start}, {end}) x n={rollout_n} "
                f"({marker.num_trajectories} committed, {marker.failures} failed, {filtered} filtered as overlong): its input changed "
                "since the run was planned; nothing merged. Restore the input files and run the command again with another "
                "trainer.default_local_dir"
            )


# --- reading a run folder -------------------------------------------------------------------


@dataclass
class CommittedPart:
    ref: CommittedPartRef
    positions: np.ndarray = field(repr=False)
    """Where each of the part's rows goes in the (index, rollout_n) order of the whole run."""


@dataclass
class MergeInput:
    """The committed parts of a run, where each of their rows goes, and the run-wide layout."""

    parts: list[CommittedPart]
    rows: int
    layout: BatchLayout
    images: ImageMerge | None = None
    """The run's processor, for a run with images (`image_merge`)."""


def scan_run(folder: StorageFolder) -> MergeInput:
    """First pass over the parts, reading only small columns: the global order of every row and
    the layout all output files share. The token columns are read in the second pass."""
    parts = committed_parts(folder)
    keys_index, keys_n = [], []
    scores_missing = 0
    extra_keys: set[str] = set()
    reward_key_sets: dict[tuple[str, ...], int] = {}
    reward_codes = []
    with_images = False
    for part in parts:
        table = read_part_table(
            read_verified_part(folder, part),
            ["index", "rollout_n", "reward_score", "extra_fields", "raw_prompt_shared", "image_digests"],
        )
        with_images = with_images or table.column("image_digests").null_count < table.num_rows
        keys_index.append(table.column("index").to_numpy())
        keys_n.append(table.column("rollout_n").to_numpy().astype(np.int64))
        # NaN is no score (trajectory_record.score_or_none): rm_scores only when every trajectory is scored.
        scores_missing += pc.sum(pc.invert(scored_mask(table.column("reward_score")))).as_py() or 0
        for text, shared in zip(
            table.column("extra_fields").to_pylist(), table.column("raw_prompt_shared").to_pylist(), strict=True
        ):
            extra = json.loads(text)
            extra_keys.update(extra)
            if shared:
                extra_keys.add(SHARED_RAW_PROMPT)
            info_keys = tuple(extra.get("reward_extra_info") or {})
            reward_codes.append(reward_key_sets.setdefault(info_keys, len(reward_key_sets)))
    if not parts or not sum(len(k) for k in keys_index):
        raise GenrunError("nothing to merge: no trajectory was committed")
    index, rollout_n = np.concatenate(keys_index), np.concatenate(keys_n)
    order = np.lexsort((rollout_n, index))
    sorted_index, sorted_n = index[order], rollout_n[order]
    if ((sorted_index[1:] == sorted_index[:-1]) & (sorted_n[1:] == sorted_n[:-1])).any():
        raise GenrunError(f"{folder.display()} holds duplicate trajectories; run `genrun status` on it")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    starts = np.cumsum([0, *(len(k) for k in keys_index)])
    committed = [CommittedPart(p, rank[starts[i] : starts[i + 1]]) for i, p in enumerate(parts)]

    # The first trajectory decides the dataset keys and whether logprobs are batched (as in verl).
    first_part = int(np.searchsorted(starts, order[0], side="right") - 1)
    first = read_part_table(read_verified_part(folder, parts[first_part]), ["input_fields", "response_logprobs"])
    first = first.slice(int(order[0] - starts[first_part]), 1)
    # Reward-info key sets in the order the sorted rows first show them: verl's first-seen order.
    sorted_codes = np.asarray(reward_codes, dtype=np.int64)[order]
    codes, first_seen = np.unique(sorted_codes, return_index=True)
    key_sets = {code: keys for keys, code in reward_key_sets.items()}
    seen_sets = [key_sets[int(code)] for code in codes[np.argsort(first_seen)]]
    layout = BatchLayout(
        with_logprobs=first.column("response_logprobs").null_count == 0,
        with_rm_scores=scores_missing == 0,
        input_keys=list(json.loads(first.column("input_fields")[0].as_py())),
        reward_extra_keys=list(dict.fromkeys(key for keys in seen_sets for key in keys)),
        complete_reward_keys=set.intersection(*(set(keys) for keys in seen_sets)),
        extra_keys=sorted(extra_keys | _DEFAULT_EXTRA_KEYS),
        with_images=with_images,
    )
    return MergeInput(committed, len(order), layout)


def build_rows(
    folder: StorageFolder,
    merge_input: MergeInput,
    start: int,
    stop: int,
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
) -> DataProto:
    """The DataProto of rows [start, stop) of the run's (index, rollout_n) order, reading only
    the parts that hold them, one part at a time."""
    builder = PaddedBatchBuilder(
        stop - start,
        merge_input.layout,
        prompt_length=prompt_length,
        response_length=response_length,
        pad_token_id=pad_token_id,
        images=merge_input.images,
    )
    for part in merge_input.parts:
        wanted = (part.positions >= start) & (part.positions < stop)
        if not wanted.any():
            continue
        table = read_part_table(
            read_verified_part(folder, part.ref),
            [
                *TOKEN_COLUMNS,
                "input_fields",
                "extra_fields",
                "metrics",
                "raw_prompt_shared",
                *sorted(OPTIONAL_COLUMNS),
            ],
        )
        # Before the filter: a row's images may be stored with another row of the part.
        images = decode_images(table) if merge_input.layout.with_images else None
        if not wanted.all():
            table = table.filter(pa.array(wanted))
            images = (
                None if images is None else [row for row, keep in zip(images, wanted.tolist(), strict=True) if keep]
            )
        positions = part.positions[wanted] - start
        builder.add(table, positions, *decode_fields(table), images=images)
        builder.add_provenance(positions, *decode_provenance(table), storage_seconds=part.ref.storage_seconds_per_row)
    return builder.finish()


@dataclass
class MergedOutput:
    """What a merge wrote, for the run summary."""

    entry_file: str
    """`trajectories.pkl`, or `trajectories.json` listing the chunk files."""
    rows: int
    generate_seconds: np.ndarray
    """Each trajectory's time waiting on the engine (verl's `generate_sequences` metric)."""
    bytes: int | None = None
    """trajectories.pkl's size (None for chunks: trajectories.json lists theirs)."""
    padded_row_bytes: int | None = None
    """The estimate of a row's padded bytes that decides whether the merge writes chunks
    (merged_output.merge_chunk_rows): recorded so that a rerun can tell the layout it would write."""


def merge_run(
    folder: StorageFolder,
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    merge_input: MergeInput | None = None,
) -> DataProto:
    """Merge every committed trajectory into one `trajectories.pkl`; returns its DataProto.
    `merge_input`: the run's scan, when the caller has made it."""
    merge_input = merge_input or scan_run(folder)
    data = build_rows(
        folder,
        merge_input,
        0,
        merge_input.rows,
        prompt_length=prompt_length,
        response_length=response_length,
        pad_token_id=pad_token_id,
    )
    _write_merged(folder, data)
    return data


def _write_merged(folder: StorageFolder, data: DataProto) -> int:
    """`data` as trajectories.pkl, the other layout's files removed; returns the file's bytes."""
    with folder.open_write(MERGED_FILE) as handle:
        size, _ = dump_dataproto(data, handle)
    remove_stale_merge_output(folder, keep={MERGED_FILE})
    logger.debug("merged %d trajectories into %s", len(data), folder.display(MERGED_FILE))
    return size


def merge_run_chunked(
    folder: StorageFolder,
    *,
    chunk_size: int,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    merge_input: MergeInput | None = None,
) -> MergedOutput:
    """Merge into `trajectories-NNNNN.pkl` files of at most `chunk_size` rows in (index,
    rollout_n) order, padded identically, then `trajectories.json` listing them (written last:
    it is what makes a set of chunk files current). Holds one chunk in memory at a time."""
    merge_input = merge_input or scan_run(folder)
    # The chunk files are rewritten in place: a crash from here on must not leave an index that
    # lists them (a trajectories.pkl of an earlier merge stays valid until the new index is written).
    folder.remove(CHUNK_INDEX_FILE)
    chunks: list[dict[str, Any]] = []
    generate_seconds: list[np.ndarray] = []
    for number, start in enumerate(range(0, merge_input.rows, chunk_size)):
        stop = min(start + chunk_size, merge_input.rows)
        data = build_rows(
            folder,
            merge_input,
            start,
            stop,
            prompt_length=prompt_length,
            response_length=response_length,
            pad_token_id=pad_token_id,
        )
        name = chunk_file_name(number)
        with folder.open_write(name) as handle:
            size, sha256 = dump_dataproto(data, handle)
        chunks.append({"name": name, "rows": stop - start, "first_row": start, "bytes": size, "sha256": sha256})
        generate_seconds.append(_generate_seconds(data))
        del data  # before the next chunk is built: one chunk in memory
    folder.put_json(
        CHUNK_INDEX_FILE,
        {
            "rows": merge_input.rows,
            "chunk_size": chunk_size,
            "prompt_length": prompt_length,
            "response_length": response_length,
            "order": "index, rollout_n",
            "chunks": chunks,
        },
    )
    remove_stale_merge_output(folder, keep={CHUNK_INDEX_FILE, *(chunk["name"] for chunk in chunks)})
    logger.debug(
        "merged %d trajectories into %d chunk(s) listed in %s",
        merge_input.rows,
        len(chunks),
        folder.display(CHUNK_INDEX_FILE),
    )
    return MergedOutput(CHUNK_INDEX_FILE, merge_input.rows, np.concatenate(generate_seconds))


def merge_output(
    folder: StorageFolder, padding: Padding, chunk_size: int | None = None, max_file_bytes: int | None = None
) -> MergedOutput:
    """Merge the committed parts as a run is configured: chunk files of at most `chunk_size`
    rows listed in trajectories.json; without a chunk size, one trajectories.pkl while the run's
    padded DataProto stays under `max_file_bytes` (generation.merge_max_file_bytes), else chunks of that size."""
    lengths = dict(
        prompt_length=padding.prompt_length, response_length=padding.response_length, pad_token_id=padding.pad_token_id
    )
    # The caller holds the run's lease: what a merge or zip killed before its rename left goes.
    remove_leftover_temporaries(folder)
    merge_input = scan_run(folder)
    if merge_input.layout.with_images:
        merge_input.images = image_merge(folder)
    row_bytes = padded_row_bytes(merge_input.layout, padding)
    chunk_rows = merge_chunk_rows(
        merge_input.rows, row_bytes, chunk_size, max_file_bytes or GenerationSettings.merge_max_file_bytes
    )
    if chunk_rows and not chunk_size:
        logger.info(
            "%d trajectories take about %.1f GiB padded: merging into chunks of %d (generation.merge_max_file_bytes)",
            merge_input.rows,
            merge_input.rows * row_bytes / (1 << 30),
            chunk_rows,
        )
    if chunk_rows:
        chunked = merge_run_chunked(folder, chunk_size=chunk_rows, merge_input=merge_input, **lengths)
        return dataclasses.replace(chunked, padded_row_bytes=row_bytes)
    data = build_rows(folder, merge_input, 0, merge_input.rows, **lengths)
    size = _write_merged(folder, data)
    return MergedOutput(MERGED_FILE, len(data), _generate_seconds(data), size, row_bytes)


def image_merge(folder: StorageFolder) -> ImageMerge:
    """The processor, tokenizer and data config of the run in `folder` (its run.json): what
    rebuilds its images' multi_modal_inputs and position_ids."""
    from generation_core.inputs.tokenizer import run_processor, run_tokenizer

    config = read_run_record(folder).config
    model = config["actor_rollout_ref"]["model"]
    processor = run_processor(model)
    if processor is None:
        raise GenrunError(
            f"{folder.display()} holds trajectories with images, and the run's model {model['path']} has no "
            "multimodal processor to rebuild their multi_modal_inputs"
        )
    return ImageMerge(processor, run_tokenizer(model), config.get("data"))


def _generate_seconds(data: DataProto) -> np.ndarray:
    """Each row's time waiting on the engine, from its metrics (verl's `generate_sequences`)."""
    return np.array([m.get("generate_sequences", 0.0) for m in data.meta_info["metrics"]], dtype=np.float64)
