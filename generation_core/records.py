"""The trajectory record stored in part files, and its Parquet schema.

A record is plain data and unpadded: padding is a property of one training batch, not of a
trajectory, so it is applied once at merge time (see merge.py). Token ids are int32 and masks
int8 on disk, which keeps a part file close to the raw token bytes.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PART_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int64()),
        pa.field("rollout_n", pa.int32()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("response_mask", pa.list_(pa.int8())),
        pa.field("response_logprobs", pa.list_(pa.float32()), nullable=True),
        pa.field("reward_score", pa.float64(), nullable=True),
        pa.field("num_turns", pa.int32()),
        pa.field("input_fields", pa.string()),
        pa.field("extra_fields", pa.string()),
        pa.field("metrics", pa.string()),
    ]
)


@dataclass
class TrajectoryRecord:
    """One finished trajectory: a prompt and everything the agent loop produced for it."""

    index: int
    """The sample id: the dataset's `extra_info.index`."""
    rollout_n: int
    """Which of the `rollout.n` samples of this prompt (0-based)."""
    prompt_ids: list[int]
    """Prompt token ids exactly as sent to the engine (chat template applied)."""
    response_ids: list[int]
    """Every token after the prompt: model tokens and, in multi-turn loops, tool/user tokens."""
    response_mask: list[int]
    """1 for a token the model generated, 0 for a tool/observation token."""
    response_logprobs: list[float] | None
    """The engine's log-probability of each response token (0 on mask-0 positions); None when not asked for."""
    reward_score: float | None
    """The trajectory's reward, when the agent loop or a reward function produced one."""
    num_turns: int
    """Chat turns including user, assistant and tool turns (verl's `__num_turns__`)."""
    input_fields: dict[str, Any] = field(default_factory=dict)
    """The dataset row's non-tensor fields as verl passes them to the agent loop (data_source, reward_model, ...)."""
    extra_fields: dict[str, Any] = field(default_factory=dict)
    """The agent loop's `extra_fields` (turn_scores, tool_rewards, raw_prompt, ...)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """verl's AgentLoopMetrics for this trajectory (timings in seconds)."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.index, self.rollout_n)


@dataclass
class SampleFailure:
    """A sample whose agent loop raised after the engine-request retries (a failures.jsonl line)."""

    index: int
    """The sample id (`extra_info.index`)."""
    rollout_n: int
    """Which of the `rollout.n` samples of this prompt."""
    error: str
    """`ExceptionType: message` of what failed (engine, agent loop, tool or reward function)."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.index, self.rollout_n)

    @classmethod
    def from_exception(cls, key: tuple[int, int], exc: BaseException) -> "SampleFailure":
        # Ray wraps an actor's exception; its own text starts with the actor's name, not the error.
        exc = getattr(exc, "cause", None) or exc
        message = str(exc).strip().splitlines()
        return cls(key[0], key[1], f"{type(exc).__name__}: {message[0] if message else ''}"[:2000])


def sample_key_text(key: tuple[int, int]) -> str:
    """The JSON-safe form of a sample id used in checkpoints and failure logs."""
    return f"{key[0]}:{key[1]}"


def to_json(value: Any) -> str:
    return json.dumps(value, default=_json_default, sort_keys=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, set | tuple):
        return list(value)
    raise TypeError(f"cannot store a {type(value).__name__} in a trajectory record")


def records_to_parquet(records: list[TrajectoryRecord]) -> bytes:
    columns = {
        "index": [r.index for r in records],
        "rollout_n": [r.rollout_n for r in records],
        "prompt_ids": [r.prompt_ids for r in records],
        "response_ids": [r.response_ids for r in records],
        "response_mask": [r.response_mask for r in records],
        "response_logprobs": [r.response_logprobs for r in records],
        "reward_score": [r.reward_score for r in records],
        "num_turns": [r.num_turns for r in records],
        "input_fields": [to_json(r.input_fields) for r in records],
        "extra_fields": [to_json(r.extra_fields) for r in records],
        "metrics": [to_json(r.metrics) for r in records],
    }
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns, schema=PART_SCHEMA), buffer, compression="zstd")
    return buffer.getvalue()


def records_from_parquet(data: bytes) -> list[TrajectoryRecord]:
    table = pq.read_table(io.BytesIO(data))
    rows = table.to_pylist()
    return [
        TrajectoryRecord(
            index=row["index"],
            rollout_n=row["rollout_n"],
            prompt_ids=row["prompt_ids"],
            response_ids=row["response_ids"],
            response_mask=row["response_mask"],
            response_logprobs=row["response_logprobs"],
            reward_score=row["reward_score"],
            num_turns=row["num_turns"],
            input_fields=json.loads(row["input_fields"]),
            extra_fields=json.loads(row["extra_fields"]),
            metrics=json.loads(row["metrics"]),
        )
        for row in rows
    ]
