"""Parts -> the verl DataProto training consumes, padded exactly as verl's agent loop pads it.

`PaddedBatchBuilder` reproduces `AgentLoopWorker._agent_loop_postprocess` (per-sample padding)
followed by `AgentLoopWorker._postprocess` (batching) for text models; tests compare it with
verl's own code on the same outputs. `merge_output` is the entry point: it reads every shard's
committed parts (checksums verified), orders them by (index, rollout_n) and writes either
`trajectories.pkl` (`merge_run`), which `DataProto.load_from_disk` reads, or, with a chunk size,
the same rows as `trajectories-00000.pkl, ...` of at most `chunk_size` rows plus
`trajectories.json` listing them (`merge_run_chunked`), for runs whose DataProto does not fit in
memory.

Memory: a merge holds the padded tensors of one output file plus one part. Token lists go from
Arrow straight into the padded tensors (no Python list per token), and the pickle is written
by `dump_dataproto` without the copies verl's `DataProto.__getstate__` makes.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import json
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from tensordict import TensorDict
from verl.protocol import DataProto

from generation_core.commit_log import CommittedPartRef, committed_parts, read_verified_part
from generation_core.errors import GenrunError
from generation_core.records import SHARED_RAW_PROMPT, decode_fields, read_part_table, scored_mask
from generation_core.run_folder import CHUNK_INDEX_FILE, MERGED_FILE, ShardManifest, chunk_file_name, remove_stale_merge_output
from generation_core.settings import GenerationSettings
from generation_core.storage import RunFolder
from generation_core.verl_adapter import dataproto_state

logger = logging.getLogger(__name__)

# Keys verl's _postprocess always emits among the non-tensor fields, present or not.
_DEFAULT_EXTRA_KEYS = {"turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras"}
_TOKEN_COLUMNS = ["index", "rollout_n", "prompt_ids", "response_ids", "response_mask", "response_logprobs", "reward_score", "num_turns"]


def check_shard_counts(manifests: list[ShardManifest], rollout_n: int) -> None:
    """Refuse to merge a run a shard of which does not account for every trajectory its range
    owes: committed + failed + filtered (overlong rows x n) must equal its rows x n. A shard
    that read fewer rows than planned (an input file cut or replaced under it) would otherwise
    be merged as complete, with trajectories missing."""
    for manifest in manifests:
        start, end = manifest.range
        planned = (end - start) * rollout_n
        filtered = manifest.filtered_overlong * rollout_n
        accounted = manifest.num_trajectories + manifest.failures + filtered
        if accounted != planned:
            raise GenrunError(
                f"{manifest.shard} accounts for {accounted} of the {planned} trajectories of its rows [{start}, {end}) x n={rollout_n} "
                f"({manifest.num_trajectories} committed, {manifest.failures} failed, {filtered} filtered as overlong): its input changed "
                "since the run was planned; nothing merged. Restore the input files and run the command again with another "
                "trainer.default_local_dir"
            )


@dataclass(frozen=True)
class Padding:
    """The padded widths of a run's DataProto (verl's rollout.prompt_length / response_length)."""

    prompt_length: int
    response_length: int
    pad_token_id: int


@dataclass
class BatchLayout:
    """What every output file of one merge shares, decided over all its rows, so that chunks
    pad and key identically and `DataProto.concat` of them equals the unchunked DataProto."""

    with_logprobs: bool
    """verl batches rollout_log_probs when its first sample has them."""
    with_rm_scores: bool
    """rm_scores exist only when every trajectory has a reward."""
    input_keys: list[str]
    """The first trajectory's dataset fields (verl takes the first sample's keys)."""
    reward_extra_keys: list[str]
    """Union of the reward functions' extra-info keys in first-seen order."""
    complete_reward_keys: set[str]
    """Those every trajectory has: a plain numpy array like verl's; the others are object arrays with None gaps."""
    extra_keys: list[str]
    """Sorted union of the agent loops' extra_fields keys and the ones verl always emits."""



class PaddedBatchBuilder:
    """Fills one DataProto's padded tensors from Arrow token columns, a part at a time, with
    vectorized scatters: prompts left-padded, responses right-padded, as verl pads them."""

    def __init__(self, rows: int, layout: BatchLayout, *, prompt_length: int, response_length: int, pad_token_id: int):
        self.rows, self.layout = rows, layout
        self.prompt_length, self.response_length = prompt_length, response_length
        width = prompt_length + response_length
        # prompts and responses are cut from input_ids at the end: one fill instead of three.
        self.input_ids = torch.full((rows, width), pad_token_id, dtype=torch.int64)
        self.attention_mask = torch.zeros((rows, width), dtype=torch.int64)
        self.response_mask = torch.zeros((rows, response_length), dtype=torch.int64)
        self.logprobs = torch.zeros((rows, response_length), dtype=torch.float32) if layout.with_logprobs else None
        self.rm_scores = torch.zeros((rows, response_length), dtype=torch.float32) if layout.with_rm_scores else None
        self.num_turns = np.zeros(rows, dtype=np.int32)
        keys = [*layout.input_keys, *layout.extra_keys]
        self.objects = {key: np.empty(rows, dtype=object) for key in dict.fromkeys(keys)}
        self.reward_objects = {key: np.empty(rows, dtype=object) for key in layout.reward_extra_keys}
        self.metrics: list[Any] = [None] * rows
        self.filled = 0

    def add(self, tokens: pa.Table, positions: np.ndarray, inputs: list[dict], extras: list[dict], metrics: list[dict]) -> None:
        """Place the rows of `tokens` (columns as in a part) at `positions` of the batch."""
        prompt_values, prompt_lengths = _flat_lists(tokens.column("prompt_ids"))
        response_values, response_lengths = _flat_lists(tokens.column("response_ids"))
        mask_values, mask_lengths = _flat_lists(tokens.column("response_mask"))
        self._check_lengths(tokens, prompt_lengths, response_lengths)
        P, R = self.prompt_length, self.response_length
        input_ids = self.input_ids.numpy()
        _scatter(input_ids, positions, P - prompt_lengths, prompt_lengths, prompt_values)
        _scatter(input_ids, positions, np.full_like(response_lengths, P), response_lengths, response_values)
        columns = np.arange(P + R)
        self.attention_mask.numpy()[positions] = (columns >= P - prompt_lengths[:, None]) & (columns < P + response_lengths[:, None])
        _scatter(self.response_mask.numpy(), positions, np.zeros_like(mask_lengths), mask_lengths, mask_values)
        if self.logprobs is not None:
            logprob_values, logprob_lengths = _flat_lists(tokens.column("response_logprobs"))
            _scatter(self.logprobs.numpy(), positions, np.zeros_like(logprob_lengths), logprob_lengths, logprob_values)
        if self.rm_scores is not None:
            # verl puts the score on the last response token (index -1 for an empty response).
            last = np.where(response_lengths > 0, response_lengths - 1, R - 1)
            scores = tokens.column("reward_score").to_numpy(zero_copy_only=False).astype(np.float32)
            self.rm_scores.numpy()[positions, last] = scores
        self.num_turns[positions] = tokens.column("num_turns").to_numpy(zero_copy_only=False)

        layout = self.layout
        for key in layout.input_keys:
            self.objects[key][positions] = _object_array([fields.get(key) for fields in inputs])
        reward_infos = [extra.get("reward_extra_info") or {} for extra in extras]
        for key in layout.reward_extra_keys:
            self.reward_objects[key][positions] = _object_array([info.get(key) for info in reward_infos])
        for key in layout.extra_keys:
            self.objects[key][positions] = _object_array([extra.get(key) for extra in extras])
        for position, row_metrics in zip(positions.tolist(), metrics, strict=True):
            self.metrics[position] = row_metrics
        self.filled += len(positions)

    def _check_lengths(self, tokens: pa.Table, prompt_lengths: np.ndarray, response_lengths: np.ndarray) -> None:
        too_long = np.flatnonzero((prompt_lengths > self.prompt_length) | (response_lengths > self.response_length))
        if len(too_long):
            row = int(too_long[0])
            raise GenrunError(
                f"sample {tokens.column('index')[row].as_py()}:{tokens.column('rollout_n')[row].as_py()} has {int(prompt_lengths[row])} prompt / "
                f"{int(response_lengths[row])} response tokens, beyond prompt_length={self.prompt_length} / "
                f"response_length={self.response_length} of this run"
            )

    def finish(self) -> DataProto:
        if self.filled != self.rows:
            raise AssertionError(f"batch of {self.rows} rows got {self.filled}")
        P = self.prompt_length
        # verl's compute_position_id_with_mask (clip(cumsum(mask) - 1, 0)) without its temporaries.
        position_ids = torch.empty_like(self.attention_mask)
        torch.cumsum(self.attention_mask, dim=1, out=position_ids)
        position_ids.sub_(1).clamp_(min=0)
        tensors = {
            "prompts": self.input_ids[:, :P].clone(),
            "responses": self.input_ids[:, P:].clone(),
            "response_mask": self.response_mask,
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": position_ids,
        }
        if self.logprobs is not None:
            tensors["rollout_log_probs"] = self.logprobs
        if self.rm_scores is not None:
            tensors["rm_scores"] = self.rm_scores
        batch = TensorDict(tensors, batch_size=self.rows)

        layout = self.layout
        non_tensor: dict[str, np.ndarray] = {"__num_turns__": self.num_turns}
        for key in layout.input_keys:
            non_tensor[key] = self.objects[key]
        for key in layout.reward_extra_keys:
            values = self.reward_objects[key]
            non_tensor[key] = np.array(values.tolist()) if key in layout.complete_reward_keys else values
        # Text models: verl records an empty multi-modal input dict per sample.
        non_tensor["multi_modal_inputs"] = _object_array([{} for _ in range(self.rows)])
        for key in layout.extra_keys:
            non_tensor[key] = self.objects[key]

        meta_info: dict[str, Any] = {"metrics": self.metrics}
        if self.rm_scores is not None:
            meta_info["reward_extra_keys"] = list(layout.reward_extra_keys)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)


def _flat_lists(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(all values, length of each row) of a list column; a null list counts as empty."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return array.flatten().to_numpy(zero_copy_only=False), lengths


def _scatter(target: np.ndarray, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray, values: np.ndarray) -> None:
    """target[rows[i], starts[i] : starts[i] + lengths[i]] = the i-th run of `values`, for all i at once."""
    total = int(lengths.sum())
    if not total:
        return
    run_starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    columns = np.repeat(starts, lengths) + (np.arange(total) - run_starts)
    target[np.repeat(rows, lengths), columns] = values


def _object_array(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


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


def scan_run(folder: RunFolder) -> MergeInput:
    """First pass over the parts, reading only small columns: the global order of every row and
    the layout all output files share. The token columns are read in the second pass."""
    parts = committed_parts(folder)
    keys_index, keys_n = [], []
    scores_missing = 0
    extra_keys: set[str] = set()
    reward_key_sets: dict[tuple[str, ...], int] = {}
    reward_codes = []
    for part in parts:
        table = read_part_table(read_verified_part(folder, part), ["index", "rollout_n", "reward_score", "extra_fields", "raw_prompt_shared"])
        keys_index.append(table.column("index").to_numpy())
        keys_n.append(table.column("rollout_n").to_numpy().astype(np.int64))
        # NaN is no score (records.score_or_none): rm_scores only when every trajectory is scored.
        scores_missing += pc.sum(pc.invert(scored_mask(table.column("reward_score")))).as_py() or 0
        for text, shared in zip(table.column("extra_fields").to_pylist(), table.column("raw_prompt_shared").to_pylist(), strict=True):
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
    )
    return MergeInput(committed, len(order), layout)


def build_rows(folder: RunFolder, merge_input: MergeInput, start: int, stop: int, *, prompt_length: int, response_length: int, pad_token_id: int) -> DataProto:
    """The DataProto of rows [start, stop) of the run's (index, rollout_n) order, reading only
    the parts that hold them, one part at a time."""
    builder = PaddedBatchBuilder(stop - start, merge_input.layout, prompt_length=prompt_length, response_length=response_length, pad_token_id=pad_token_id)
    for part in merge_input.parts:
        wanted = (part.positions >= start) & (part.positions < stop)
        if not wanted.any():
            continue
        table = read_part_table(read_verified_part(folder, part.ref), [*_TOKEN_COLUMNS, "input_fields", "extra_fields", "metrics", "raw_prompt_shared"])
        if not wanted.all():
            table = table.filter(pa.array(wanted))
        builder.add(table, part.positions[wanted] - start, *decode_fields(table))
    return builder.finish()


# --- writing --------------------------------------------------------------------------------


class _Sink:
    """A write-only file for torch.save that passes bytes on (or only counts them) and hashes them."""

    def __init__(self, target=None):
        self.target, self.size, self.digest = target, 0, hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.size += len(view)
        self.digest.update(view)
        if self.target is not None:
            self.target.write(view)
        return len(view)

    def flush(self) -> None:
        pass


# Stands for the tensor blob while pickling the rest: larger than pickle's frame target (64 KiB),
# so the pickler writes it outside any frame, as opcode + length + payload, which can be replaced.
_BLOB_PLACEHOLDER = hashlib.sha256(b"genrun tensor blob").digest() * 4096
# Pickle's BINBYTES takes a 4-byte length; larger blobs need BINBYTES8 (protocol 4+).
_BINBYTES_LIMIT = 1 << 32


def dump_dataproto(data: DataProto, handle) -> tuple[int, str]:
    """Write what `pickle.dump(data, handle, protocol=5)` writes in substance, streaming the
    tensors to `handle` instead of through the copies verl's `DataProto.__getstate__` makes
    (contiguous, consolidate, a BytesIO and its getvalue). The file is a plain pickle of a
    DataProto whose state is (torch.save bytes of the TensorDict, non_tensor_batch, meta_info),
    the state verl's `__setstate__` reads: `pickle.load` and `DataProto.load_from_disk` load it
    wherever verl is installed. Returns the file's (size, sha256)."""

    class _StatePickler(pickle.Pickler):
        def reducer_override(self, obj):
            if obj is data:
                return copyreg.__newobj__, (DataProto,), dataproto_state(_BLOB_PLACEHOLDER, data.non_tensor_batch, data.meta_info)  # type: ignore[attr-defined]  # typeshed omits copyreg.__newobj__
            return NotImplemented

    buffer = io.BytesIO()
    _StatePickler(buffer, protocol=5).dump(data)
    rest = buffer.getvalue()
    at = rest.index(_BLOB_PLACEHOLDER)
    if rest[at - 5 : at] != b"B" + len(_BLOB_PLACEHOLDER).to_bytes(4, "little"):
        raise AssertionError("unexpected pickle layout around the tensor blob")
    # torch.save twice: once to learn the blob's length (the opcode comes before the payload), once to write it.
    counted = _Sink()
    torch.save(data.batch, counted)  # type: ignore[arg-type]  # torch types a file as IO[bytes]; it calls only write and flush
    out = _Sink(handle)
    out.write(rest[: at - 5])
    out.write(b"B" + counted.size.to_bytes(4, "little") if counted.size < _BINBYTES_LIMIT else b"\x8e" + counted.size.to_bytes(8, "little"))
    blob_start = out.size
    torch.save(data.batch, out)  # type: ignore[arg-type]  # as above
    if out.size - blob_start != counted.size:
        raise AssertionError("torch.save wrote a different blob the second time")
    out.write(rest[at + len(_BLOB_PLACEHOLDER) :])
    return out.size, out.digest.hexdigest()


@dataclass
class MergedOutput:
    """What a merge wrote, for the run summary."""

    entry_file: str
    """`trajectories.pkl`, or `trajectories.json` listing the chunk files."""
    rows: int
    generate_seconds: np.ndarray
    """Each trajectory's time waiting on the engine (verl's `generate_sequences` metric)."""


def merge_run(folder: RunFolder, *, prompt_length: int, response_length: int, pad_token_id: int, merge_input: MergeInput | None = None) -> DataProto:
    """Merge every committed trajectory into one `trajectories.pkl`; returns its DataProto.
    `merge_input`: the run's scan, when the caller has made it."""
    merge_input = merge_input or scan_run(folder)
    data = build_rows(folder, merge_input, 0, merge_input.rows, prompt_length=prompt_length, response_length=response_length, pad_token_id=pad_token_id)
    with folder.open_write(MERGED_FILE) as handle:
        dump_dataproto(data, handle)
    remove_stale_merge_output(folder, keep={MERGED_FILE})
    logger.info("merged %d trajectories into %s", len(data), folder.display(MERGED_FILE))
    return data


def merge_run_chunked(
    folder: RunFolder, *, chunk_size: int, prompt_length: int, response_length: int, pad_token_id: int, merge_input: MergeInput | None = None
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
        data = build_rows(folder, merge_input, start, stop, prompt_length=prompt_length, response_length=response_length, pad_token_id=pad_token_id)
        name = chunk_file_name(number)
        with folder.open_write(name) as handle:
            size, sha256 = dump_dataproto(data, handle)
        chunks.append({"name": name, "rows": stop - start, "first_row": start, "bytes": size, "sha256": sha256})
        generate_seconds.append(np.array([m.get("generate_sequences", 0.0) for m in data.meta_info["metrics"]], dtype=np.float64))
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
    logger.info("merged %d trajectories into %d chunk(s) listed in %s", merge_input.rows, len(chunks), folder.display(CHUNK_INDEX_FILE))
    return MergedOutput(CHUNK_INDEX_FILE, merge_input.rows, np.concatenate(generate_seconds))


def padded_row_bytes(layout: BatchLayout, padding: Padding) -> int:
    """Bytes one row takes in the merged DataProto's tensors (PaddedBatchBuilder's, and the
    prompts / responses / position_ids verl's postprocess adds), plus a conservative 1 KiB for
    its non-tensor fields: the estimate that decides when the merge writes chunks."""
    prompt, response = padding.prompt_length, padding.response_length
    # int64: input_ids, attention_mask, position_ids over prompt+response; prompts; responses and response_mask.
    tensor_bytes = 8 * (3 * (prompt + response) + prompt + 2 * response)
    tensor_bytes += 4 * response * (int(layout.with_logprobs) + int(layout.with_rm_scores))
    return tensor_bytes + 1024


def merge_output(folder: RunFolder, padding: Padding, chunk_size: int | None = None, max_file_bytes: int | None = None) -> MergedOutput:
    """Merge the committed parts as a run is configured: chunk files of at most `chunk_size`
    rows listed in trajectories.json; without a chunk size, one trajectories.pkl while the run's
    padded DataProto stays under `max_file_bytes` (generation.merge_max_file_bytes), else chunks of that size."""
    lengths = dict(prompt_length=padding.prompt_length, response_length=padding.response_length, pad_token_id=padding.pad_token_id)
    merge_input = scan_run(folder)
    if not chunk_size:
        row_bytes = padded_row_bytes(merge_input.layout, padding)
        rows_per_file = max(1, (max_file_bytes or GenerationSettings.merge_max_file_bytes) // row_bytes)
        if merge_input.rows > rows_per_file:
            logger.info(
                "%d trajectories take about %.1f GiB padded: merging into chunks of %d (generation.merge_max_file_bytes)",
                merge_input.rows, merge_input.rows * row_bytes / (1 << 30), rows_per_file,
            )
            chunk_size = rows_per_file
    if chunk_size:
        return merge_run_chunked(folder, chunk_size=chunk_size, merge_input=merge_input, **lengths)
    data = merge_run(folder, merge_input=merge_input, **lengths)
    return MergedOutput(MERGED_FILE, len(data), np.array([m.get("generate_sequences", 0.0) for m in data.meta_info["metrics"]]))
