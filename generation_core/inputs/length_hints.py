"""Longest expected first: shards and their rows dispatched by how long an earlier run's answers to
the same prompts were (`generation.longest_first_from`).

A run ends when the last of its longest answers ends, and an answer started late ends late: the
last 1% of a run's trajectories are mostly long answers to prompts that happened to come last
(bench/tail.py). Most of a response's length comes with the prompt (a hard problem gets long
answers on every sample, and again the next night), so an earlier run over the same prompts says
which ones to start first. The plan orders the shards by their longest expected prompt (then by
their expected total), and each shard job dispatches its rows longest first; prompts the earlier
run did not answer count as its mean. Only the order changes: what is generated, the sample keys,
exactly-once commits and resume are the same as without it (commits are by sample key).

The driver writes the per-prompt figures to the run folder (`LENGTH_HINTS_FILE`, sorted by sample
index) so each shard job reads only the rows of its own index range.
"""

from __future__ import annotations

import io
import logging
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from generation_core.errors import GenrunError
from generation_core.run_plan import DatasetFiles, ShardSpec
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts, read_verified_part
from generation_core.store.run_folder import RUN_FILE
from generation_core.store.run_record import RunRecord
from generation_core.store.trajectory_record import read_part_table

logger = logging.getLogger(__name__)

LENGTH_HINTS_FILE = "length_hints.parquet"
HINT_ROW_GROUP = 65_536
"""Rows per row group of LENGTH_HINTS_FILE: a shard job's index range prunes the rest."""


class LengthHints:
    """Mean response tokens per sample index (`indices` sorted, unique)."""

    def __init__(self, indices: np.ndarray, tokens: np.ndarray, source: str | None = None, prompt_share: float | None = None):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.tokens = np.asarray(tokens, dtype=np.float64)
        self.source = source
        """The earlier run folder the figures come from (None: read back from the run folder's file)."""
        self.prompt_share = prompt_share
        """The share of the earlier run's log-length variance between prompts (prompt_share_of_lengths)."""

    def describe(self) -> dict[str, Any]:
        """What manifest.json records of the order's source: a run's order is part of its story."""
        return {"from": self.source, "prompts": len(self), "mean_tokens": round(float(self.tokens.mean()), 1) if len(self) else None,
                "prompt_share": None if self.prompt_share is None else round(self.prompt_share, 3)}

    def __len__(self) -> int:
        return len(self.indices)

    def expected(self, indices: np.ndarray) -> np.ndarray:
        """Expected response tokens for each of `indices`; an index without a figure gets the mean."""
        indices = np.asarray(indices, dtype=np.int64)
        fallback = float(self.tokens.mean()) if len(self.tokens) else 0.0
        if not len(self.indices):
            return np.full(len(indices), fallback)
        at = np.searchsorted(self.indices, indices).clip(0, len(self.indices) - 1)
        found = self.indices[at] == indices
        return np.where(found, self.tokens[at], fallback)

    def to_parquet(self) -> bytes:
        sink = io.BytesIO()
        pq.write_table(pa.table({"index": self.indices, "tokens": self.tokens.astype(np.float32)}), sink, row_group_size=HINT_ROW_GROUP)
        return sink.getvalue()

    @classmethod
    def from_parquet(cls, data: bytes, lo: int | None = None, hi: int | None = None) -> LengthHints:
        """The figures of indices in [lo, hi] (all without bounds), reading only the row groups that hold them."""
        filters = None if lo is None or hi is None else [("index", ">=", int(lo)), ("index", "<=", int(hi))]
        table = pq.read_table(io.BytesIO(data), filters=filters)
        return cls(table.column("index").to_numpy(), table.column("tokens").to_numpy())


def earlier_run_folder(source: str, storage_options: dict[str, Any], dataset: DatasetFiles | None, this_run: str | None) -> StorageFolder | None:
    """`source` itself when it is a run folder (it holds run.json); else the newest run folder
    directly under it (by run.json's `created`) over the same prompts as `dataset` (the same
    files, row counts and content digests), other than `this_run`: a nightly schedule names the
    folder its runs go under once, and its first night finds none there (None). Only run.json is
    read (JSON: nothing in the folder runs)."""
    folder = StorageFolder(source, storage_options)
    wanted = _prompts_of(dataset.to_dict()) if dataset is not None else None
    if folder.exists(RUN_FILE):
        record = _record(folder)
        if wanted is not None and _prompts_of(record.dataset if record is not None else None) != wanted:
            logger.warning("longest first: %s read other data files than this run (or other versions of them); its figures are matched "
                           "to this run's prompts by sample index (extra_info.index)", folder.display())
        return folder
    if not folder.fs.isdir(folder.path("")):
        raise GenrunError(f"generation.longest_first_from={source}: no such folder; name the output folder of an earlier run over the same prompts, "
                          "or the folder such runs go under, or set it to null")
    here = StorageFolder(this_run, storage_options).path("") if this_run else None
    runs: list[tuple[str, StorageFolder]] = []
    for name in folder.list(""):
        candidate = StorageFolder(folder.display(name), storage_options)
        record = _record(candidate) if candidate.path("") != here else None
        if record is not None and (wanted is None or _prompts_of(record.dataset) == wanted):
            runs.append((record.created or "", candidate))
    # The newest with a committed trajectory: last night's run may have failed before its first part.
    for _, candidate in sorted(runs, key=lambda run: run[0], reverse=True):
        if committed_parts(candidate):
            logger.info("longest first: %s is the newest earlier run over the same prompts under %s", candidate.display(), folder.display())
            return candidate
    logger.warning("longest first: %s holds no earlier run over the same prompts (the same data files, row counts and contents) with a "
                   "committed trajectory yet: shards by id, rows in dataset order", folder.display())
    return None


def _record(folder: StorageFolder) -> RunRecord | None:
    """The folder's run.json; None where it has none, or none this genrun can read."""
    if not folder.exists(RUN_FILE):
        return None
    try:
        return RunRecord.from_json(folder.read_json(RUN_FILE))
    except (ValueError, TypeError, AttributeError):
        return None


def _prompts_of(dataset: dict[str, Any] | None) -> list[tuple[Any, Any]] | None:
    """What says two runs read the same prompts: each file's row count and content digest."""
    if not dataset:
        return None
    return [(f.get("rows"), f.get("digest")) for f in dataset.get("files") or []]


def earlier_lengths(source: str, storage_options: dict[str, Any], dataset: DatasetFiles | None = None, this_run: str | None = None) -> LengthHints | None:
    """Mean response tokens (response_mask: the model's tokens, not tools') per sample index over
    every committed trajectory of the earlier run at `source` (earlier_run_folder); None where
    there is none yet, or where the prompt decides under LOW_PROMPT_SHARE of the lengths there.
    Reads the index and response_mask columns of every committed part: about one byte per
    response token."""
    how = "name the output folder of an earlier run over the same prompts (its trajectories are read), or set it to null"
    try:
        folder = earlier_run_folder(source, storage_options, dataset, this_run)
    except OSError as exc:
        raise GenrunError(f"generation.longest_first_from={source}: cannot read it ({exc}); {how}") from None
    if folder is None:
        return None
    try:
        parts = committed_parts(folder)
    except (OSError, ValueError) as exc:
        raise GenrunError(f"generation.longest_first_from={source}: cannot read its committed parts ({exc}); {how}") from None
    if not parts:
        raise GenrunError(f"generation.longest_first_from={source}: no committed trajectories there; {how}")
    index_arrays, length_arrays = [], []
    for part in parts:
        table = read_part_table(read_verified_part(folder, part), ["index", "response_mask"])
        masks = table.column("response_mask").combine_chunks()
        flat = pc.list_flatten(masks).to_numpy(zero_copy_only=False).astype(np.int64)
        owners = pc.list_parent_indices(masks).to_numpy()
        index_arrays.append(table.column("index").to_numpy())
        length_arrays.append(np.bincount(owners, weights=flat, minlength=table.num_rows))
    indices, lengths = np.concatenate(index_arrays), np.concatenate(length_arrays)
    unique, inverse = np.unique(indices, return_inverse=True)
    sums = np.bincount(inverse, weights=lengths)
    counts = np.bincount(inverse)
    share = prompt_share_of_lengths(inverse, lengths)
    hints = LengthHints(unique, sums / counts, folder.display(), share)
    logger.info("longest first: response lengths of %d prompts from %s (%d trajectories, mean %.0f tokens; the prompt decides %s of their log-variance)",
                len(unique), folder.display(), len(indices), float(lengths.mean()), "?" if share is None else f"{share:.0%}")
    if share is not None and share < LOW_PROMPT_SHARE:
        logger.warning("longest first: in %s a prompt's samples differ in length about as much as different prompts' do (the prompt decides %.0f%% "
                       "of the log-variance, under %.0f%%): an order by them is noise, so this run keeps the dataset's order (bench/RESULTS.md: "
                       "longest first)", folder.display(), 100 * share, 100 * LOW_PROMPT_SHARE)
        return None
    return hints


LOW_PROMPT_SHARE = 0.2
"""Below this share of the lengths' log-variance between prompts, an order by them is noise and is
not applied: on the simulator (bench/tail.py --longest-first) shares 0.2-0.8 shortened the end of
64-shard runs, while at share 0 the order gave no gain and made 512-shard runs up to 1.05x longer
(ordering shards by a noisy longest prompt puts the biggest shards first)."""


def prompt_share_of_lengths(groups: np.ndarray, lengths: np.ndarray) -> float | None:
    """The share of the log-lengths' variance between prompts (one-way ANOVA intraclass
    correlation, clipped to [0, 1]); `groups[i]`: trajectory i's prompt number. None where there
    are fewer than two prompts or no prompt with two samples."""
    values = np.log(np.maximum(lengths, 1.0))
    sizes = np.bincount(groups).astype(np.float64)
    k, total = int((sizes > 0).sum()), float(len(values))
    if k < 2 or total <= k:
        return None
    means = np.bincount(groups, weights=values) / np.maximum(sizes, 1.0)
    grand = float(values.mean())
    between = float((sizes * (means - grand) ** 2).sum()) / (k - 1)
    within = float(((values - means[groups]) ** 2).sum()) / (total - k)
    n0 = (total - float((sizes**2).sum()) / total) / (k - 1)
    denominator = between + (n0 - 1) * within
    if denominator <= 0:
        return None
    return float(min(max((between - within) / denominator, 0.0), 1.0))


def hints_for_run(cfg: Any, dataset: DatasetFiles) -> LengthHints | None:
    """The run's figures from generation.longest_first_from (read with storage.options); None without it."""
    source = cfg.generation.get("longest_first_from")
    if not source:
        return None
    from omegaconf import OmegaConf

    options = cast(dict[str, Any], OmegaConf.to_container(cfg.storage.options))
    return earlier_lengths(str(source), options, dataset, str(cfg.trainer.default_local_dir))


def shards_longest_first(shards: list[ShardSpec], row_indices: np.ndarray, hints: LengthHints) -> list[ShardSpec]:
    """The shards by their longest expected prompt, then their expected total, longest first.
    `row_indices`: the sample index of every dataset row the run uses, in row order."""
    expected = hints.expected(row_indices)

    def key(shard: ShardSpec) -> tuple[float, float, int]:
        rows = expected[shard.start:shard.end]
        return (-float(rows.max()) if len(rows) else 0.0, -float(rows.sum()), shard.shard_id)

    return sorted(shards, key=key)


def rows_longest_first(row_indices: np.ndarray, hints: LengthHints) -> list[int]:
    """Row positions 0..len-1 by expected length, longest first (ties in row order)."""
    expected = hints.expected(row_indices)
    return [int(row) for row in np.argsort(-expected, kind="stable")]


def write_hints(folder: StorageFolder, hints: LengthHints | None) -> None:
    """The figures the shard jobs order their rows by; None: none this time (an earlier
    invocation's file would order a resumed shard by figures this one did not take)."""
    if hints is not None:
        folder.put_atomic(LENGTH_HINTS_FILE, hints.to_parquet())
    elif folder.exists(LENGTH_HINTS_FILE):
        folder.remove(LENGTH_HINTS_FILE)


def read_hints_for(folder: StorageFolder, row_indices: np.ndarray) -> LengthHints | None:
    """The run folder's figures for a shard's rows; None where the driver wrote none."""
    if not len(row_indices) or not folder.exists(LENGTH_HINTS_FILE):
        return None
    return LengthHints.from_parquet(folder.read_bytes(LENGTH_HINTS_FILE), int(row_indices.min()), int(row_indices.max()))
