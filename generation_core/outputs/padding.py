"""The merged DataProto's padded tensors, built as verl's agent loop builds them:
`PaddedBatchBuilder` reproduces `AgentLoopWorker._agent_loop_postprocess` (per-sample padding)
followed by `AgentLoopWorker._postprocess` (batching) for text models, filling the tensors from
Arrow token columns with vectorized scatters (no Python list per token). tests/merge_oracles.py
compares it with verl's own code on the same outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from tensordict import TensorDict
from verl.protocol import DataProto

from generation_core.errors import GenrunError

PROVENANCE_KEY = "genrun_provenance"
"""The merged DataProto's non-tensor column of each trajectory's provenance (trajectory_record.PROVENANCE_KEYS)."""
TIMINGS_KEY = "genrun_timings"
"""The merged DataProto's non-tensor column of each trajectory's time split (trajectory_record.TIMINGS and `storage`)."""
RUN_DEPENDENT_KEYS = (PROVENANCE_KEY, TIMINGS_KEY)
"""Non-tensor columns that differ between two runs that made the same trajectories (which
replica, which attempt, how long): a resumed run equals an undisturbed one in every other."""


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
    with_images: bool = False
    """Some trajectory has images: multi_modal_inputs and position_ids are the processor's (`ImageMerge`)."""


@dataclass(frozen=True)
class ImageMerge:
    """What rebuilds a multimodal run's rows as verl's postprocess builds them: the run's processor
    and tokenizer and its `data` config (mm_processor_kwargs)."""

    processor: Any
    tokenizer: Any
    data_config: Any = None


class PaddedBatchBuilder:
    """Fills one DataProto's padded tensors from Arrow token columns, a part at a time, with
    vectorized scatters: prompts left-padded, responses right-padded, as verl pads them."""

    def __init__(
        self,
        rows: int,
        layout: BatchLayout,
        *,
        prompt_length: int,
        response_length: int,
        pad_token_id: int,
        images: ImageMerge | None = None,
    ):
        self.rows, self.layout = rows, layout
        self.image_merge = images
        self.images: list[list[bytes] | None] = [None] * rows
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
        self.provenance = np.full(rows, None, dtype=object)
        self.timings = np.full(rows, None, dtype=object)
        self.filled = 0

    def add(
        self,
        tokens: pa.Table,
        positions: np.ndarray,
        inputs: list[dict],
        extras: list[dict],
        metrics: list[dict],
        images: list[list[bytes] | None] | None = None,
    ) -> None:
        """Place the rows of `tokens` (columns as in a part) at `positions` of the batch; `images`:
        each row's PNG images (store/trajectory_record.decode_images)."""
        for position, row_images in zip(positions.tolist(), images or [], strict=False):
            self.images[position] = row_images
        prompt_values, prompt_lengths = _flat_lists(tokens.column("prompt_ids"))
        response_values, response_lengths = _flat_lists(tokens.column("response_ids"))
        mask_values, mask_lengths = _flat_lists(tokens.column("response_mask"))
        self._check_lengths(tokens, prompt_lengths, response_lengths)
        P, R = self.prompt_length, self.response_length
        input_ids = self.input_ids.numpy()
        _scatter(input_ids, positions, P - prompt_lengths, prompt_lengths, prompt_values)
        _scatter(input_ids, positions, np.full_like(response_lengths, P), response_lengths, response_values)
        columns = np.arange(P + R)
        self.attention_mask.numpy()[positions] = (columns >= P - prompt_lengths[:, None]) & (
            columns < P + response_lengths[:, None]
        )
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
            self.objects[key][positions] = object_array([fields.get(key) for fields in inputs])
        reward_infos = [extra.get("reward_extra_info") or {} for extra in extras]
        for key in layout.reward_extra_keys:
            self.reward_objects[key][positions] = object_array([info.get(key) for info in reward_infos])
        for key in layout.extra_keys:
            self.objects[key][positions] = object_array([extra.get(key) for extra in extras])
        for position, row_metrics in zip(positions.tolist(), metrics, strict=True):
            self.metrics[position] = row_metrics
        self.filled += len(positions)

    def add_provenance(
        self,
        positions: np.ndarray,
        provenance: list[dict | None],
        timings: list[dict | None],
        *,
        storage_seconds: float | None,
    ) -> None:
        """Each row's provenance and time split (trajectory_record.TIMINGS, plus `storage`: its part's
        write time over its rows); None for rows of parts written before genrun kept them."""
        self.provenance[positions] = object_array(provenance)
        self.timings[positions] = object_array(
            [None if split is None else dict(split, storage=storage_seconds) for split in timings]
        )

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
        multi_modal_inputs = None
        if self.image_merge is not None:
            position_ids, multi_modal_inputs = self._image_rows(self.image_merge)
        else:
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
        non_tensor["multi_modal_inputs"] = (
            object_array([{} for _ in range(self.rows)]) if multi_modal_inputs is None else multi_modal_inputs
        )
        for key in layout.extra_keys:
            non_tensor[key] = self.objects[key]
        # genrun's own: where each trajectory was made and where its time went (store/trajectory_record.py).
        non_tensor[PROVENANCE_KEY] = self.provenance
        non_tensor[TIMINGS_KEY] = self.timings

        meta_info: dict[str, Any] = {"metrics": self.metrics}
        if self.rm_scores is not None:
            meta_info["reward_extra_keys"] = list(layout.reward_extra_keys)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)

    def _image_rows(self, merge: ImageMerge) -> tuple[torch.Tensor, np.ndarray]:
        """(position_ids (rows, 4, width), multi_modal_inputs per row) from each row's padded ids
        and its images, by verl's own per-sample postprocess (verl_adapter.multimodal_postprocess).
        The images are decoded once per distinct PNG of this batch (a prompt's n samples share them)."""
        from generation_core.inputs.images import open_png
        from generation_core.verl_adapter import multimodal_postprocess

        opened: dict[bytes, Any] = {}
        positions, inputs = [], []
        for row in range(self.rows):
            for data in self.images[row] or []:
                if data not in opened:
                    opened[data] = open_png(data)
            images = [opened[data] for data in self.images[row] or []]
            row_inputs, row_positions = multimodal_postprocess(
                merge.processor,
                merge.tokenizer,
                self.input_ids[row : row + 1],
                self.attention_mask[row : row + 1],
                images,
                merge.data_config,
            )
            positions.append(row_positions)
            inputs.append(row_inputs)
        return torch.cat(positions, dim=0), object_array(inputs)


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


def object_array(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def padded_row_bytes(layout: BatchLayout, padding: Padding) -> int:
    """Bytes one row takes in the merged DataProto's tensors (PaddedBatchBuilder's, and the
    prompts / responses / position_ids verl's postprocess adds), plus a conservative 1 KiB for
    its non-tensor fields: the estimate that decides when the merge writes chunks."""
    prompt, response = padding.prompt_length, padding.response_length
    # int64: input_ids, attention_mask, position_ids over prompt+response; prompts; responses and response_mask.
    tensor_bytes = 8 * (3 * (prompt + response) + prompt + 2 * response)
    tensor_bytes += 4 * response * (int(layout.with_logprobs) + int(layout.with_rm_scores))
    return tensor_bytes + 1024
