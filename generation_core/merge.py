"""Parts -> the verl DataProto training consumes, padded exactly as verl's agent loop pads it.

`build_dataproto` is one pure function: it reproduces `AgentLoopWorker._agent_loop_postprocess`
(per-sample padding) followed by `AgentLoopWorker._postprocess` (batching) for text models, and
tests compare it with verl's own code on the same outputs. `merge_run` reads every shard's
committed parts (checksums verified), orders them by (index, rollout_n) and writes
`trajectories.pkl`, which `DataProto.load_from_disk` reads.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask

from generation_core.errors import GenrunError
from generation_core.records import TrajectoryRecord, records_from_parquet
from generation_core.shard import CHECKPOINT
from generation_core.storage import RunFolder

logger = logging.getLogger(__name__)

MERGED_FILE = "trajectories.pkl"
# Keys verl's _postprocess always emits among the non-tensor fields, present or not.
_DEFAULT_EXTRA_KEYS = {"turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras"}


def build_dataproto(
    records: list[TrajectoryRecord], *, prompt_length: int, response_length: int, pad_token_id: int
) -> DataProto:
    """Pad and batch `records` (in the given order) the way verl's agent loop does."""
    if not records:
        raise GenrunError("nothing to merge: no trajectory was committed")
    batch_size = len(records)
    prompts = torch.full((batch_size, prompt_length), pad_token_id, dtype=torch.int64)
    responses = torch.full((batch_size, response_length), pad_token_id, dtype=torch.int64)
    prompt_attention = torch.zeros((batch_size, prompt_length), dtype=torch.int64)
    response_attention = torch.zeros((batch_size, response_length), dtype=torch.int64)
    response_mask = torch.zeros((batch_size, response_length), dtype=torch.int64)
    with_logprobs = records[0].response_logprobs is not None
    logprobs = torch.zeros((batch_size, response_length), dtype=torch.float32) if with_logprobs else None

    for row, record in enumerate(records):
        p, r = len(record.prompt_ids), len(record.response_ids)
        if p > prompt_length or r > response_length:
            raise GenrunError(
                f"sample {record.index}:{record.rollout_n} has {p} prompt / {r} response tokens, beyond "
                f"prompt_length={prompt_length} / response_length={response_length} of this run"
            )
        if p:
            prompts[row, prompt_length - p :] = torch.tensor(record.prompt_ids, dtype=torch.int64)
            prompt_attention[row, prompt_length - p :] = 1
        if r:
            responses[row, :r] = torch.tensor(record.response_ids, dtype=torch.int64)
            response_attention[row, :r] = 1
            response_mask[row, :r] = torch.tensor(record.response_mask, dtype=torch.int64)
        if with_logprobs:
            values = record.response_logprobs or []
            if values:
                logprobs[row, : len(values)] = torch.tensor(values, dtype=torch.float32)

    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
    }
    if with_logprobs:
        tensors["rollout_log_probs"] = logprobs
    batch = TensorDict(tensors, batch_size=batch_size)

    scores = [record.reward_score for record in records]
    if all(score is not None for score in scores):
        # verl puts the score on the last response token (index -1 for an empty response).
        last = response_attention.sum(dim=1) - 1
        rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
        rm_scores[torch.arange(batch_size), last] = torch.tensor(scores, dtype=torch.float32)
        batch["rm_scores"] = rm_scores

    non_tensor: dict[str, np.ndarray] = {"__num_turns__": np.array([r.num_turns for r in records], dtype=np.int32)}
    input_keys = list(records[0].input_fields)
    for key in input_keys:
        non_tensor[key] = _object_array([r.input_fields.get(key) for r in records])
    reward_infos = [r.extra_fields.get("reward_extra_info") or {} for r in records]
    # verl takes the first sample's keys; a reward function whose dict keys vary per sample
    # (or a run where some samples have none) would lose or fail on the others, so take the
    # union in first-seen order and leave None where a sample lacks a key.
    reward_extra_keys = list(dict.fromkeys(key for info in reward_infos for key in info))
    for key in reward_extra_keys:
        values = [info.get(key) for info in reward_infos]
        non_tensor[key] = np.array(values) if all(key in info for info in reward_infos) else _object_array(values)
    # Text models: verl records an empty multi-modal input dict per sample.
    non_tensor["multi_modal_inputs"] = _object_array([{} for _ in records])
    # Sorted, not set order: the same records must pickle to the same bytes in every process.
    extra_keys = sorted({key for r in records for key in r.extra_fields} | _DEFAULT_EXTRA_KEYS)
    for key in extra_keys:
        non_tensor[key] = _object_array([r.extra_fields.get(key) for r in records])

    meta_info: dict[str, Any] = {"metrics": [r.metrics for r in records]}
    if "rm_scores" in batch.keys():
        meta_info["reward_extra_keys"] = reward_extra_keys
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)


def _object_array(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def read_committed_records(folder: RunFolder) -> list[TrajectoryRecord]:
    """Every committed trajectory of every shard, checksums verified, sorted by (index, rollout_n)."""
    records: list[TrajectoryRecord] = []
    for shard_name in folder.list("shards"):
        checkpoint_path = f"shards/{shard_name}/{CHECKPOINT}"
        if not folder.exists(checkpoint_path):
            continue
        for part in folder.read_json(checkpoint_path)["parts"]:
            part_path = f"shards/{shard_name}/{part['name']}"
            data = folder.read_bytes(part_path)
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise GenrunError(f"part {folder.display(part_path)} does not match the checksum its checkpoint recorded")
            records.extend(records_from_parquet(data))
    records.sort(key=lambda r: r.key)
    keys = [r.key for r in records]
    if len(set(keys)) != len(keys):
        raise GenrunError(f"{folder.display()} holds duplicate trajectories; run `genrun status` on it")
    return records


def merge_run(folder: RunFolder, *, prompt_length: int, response_length: int, pad_token_id: int) -> DataProto:
    records = read_committed_records(folder)
    data = build_dataproto(records, prompt_length=prompt_length, response_length=response_length, pad_token_id=pad_token_id)
    with folder.open_write(MERGED_FILE) as handle:
        pickle.dump(data, handle, protocol=pickle.HIGHEST_PROTOCOL)
    logger.info("merged %d trajectories into %s", len(records), folder.display(MERGED_FILE))
    return data
