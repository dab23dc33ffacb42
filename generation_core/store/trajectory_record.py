"""The trajectory record stored in part files, and its Parquet schema.

A record is plain data and unpadded: padding is a property of one training batch, not of a
trajectory, so it is applied once at merge time (see merge.py). Token ids are int32 and masks
int8 on disk, and the part layout is chosen to stay close to the raw token bytes (see
`records_to_parquet`). The merge reads parts column-wise (`read_part_table`, `decode_fields`)
instead of building a record per row.
"""

from __future__ import annotations

import base64
import copy
import datetime
import decimal
import hashlib
import io
import json
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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
        # True where extra_fields["raw_prompt"] was equal to input_fields["raw_prompt"] (verl's
        # postprocessing copies the chat messages there) and is stored once, in input_fields.
        # Parts written before this column existed keep raw_prompt in extra_fields.
        pa.field("raw_prompt_shared", pa.bool_()),
        # Where and how the trajectory was made (PROVENANCE_KEYS, as JSON) and where its time
        # went (TIMINGS, seconds). Parts written before these columns existed read as null.
        pa.field("provenance", pa.string(), nullable=True),
        *(
            pa.field(f"seconds_{name}", pa.float32(), nullable=True)
            for name in ("slot_wait", "prefill", "decode", "tools", "reward")
        ),
        # The images (docs/multimodal.md): each one's sha256, and the PNG of those no earlier row of
        # the same write holds (a prompt's n samples store it once). Null: text, or an older part.
        pa.field("image_digests", pa.list_(pa.string()), nullable=True),
        pa.field("image_bytes", pa.list_(pa.binary()), nullable=True),
    ]
)
SHARED_RAW_PROMPT = "raw_prompt"
TIMINGS = ("slot_wait", "prefill", "decode", "tools", "reward")
"""A trajectory's time split, in seconds, summed over its turns: waiting for a slot in the
engine's batch and prefill (null where the engine does not report them), decode (the rest of
each request's time, retries included), tool calls (verl's tool_calls metric), the reward
function (null without one). The storage share is its part's write time over its rows
(`PartEntry.storage_seconds`), known once the part is committed: the merge adds it."""
PROVENANCE_KEYS = (
    "engine",
    "engine_version",
    "model_digest",
    "seed",
    "sampling_digest",
    "attempt",
    "retries",
    "started_at",
    "turns",
)
"""What `TrajectoryRecord.provenance` holds: the engine (rollout.name) and its version, the
model's digest (the fingerprint's model identity), the sample's seed (null without
generation.sample_seed), a digest of the sampling parameters, the shard attempt that made it,
engine requests resent, when it started (Unix seconds) and one entry per model turn: `replica`
(the server that answered), `stop_reason`, `start` (seconds after the trajectory's start),
`seconds`, `tokens`, and where the engine reports them `slot_wait`, `prefill` and `prefix_hit`."""


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
    """The trajectory's reward, when the agent loop or a reward function produced one; None
    otherwise. A NaN score means no score (`score_or_none`): it is stored and read as None."""
    num_turns: int
    """Chat turns including user, assistant and tool turns (verl's `__num_turns__`)."""
    input_fields: dict[str, Any] = field(default_factory=dict)
    """The dataset row's non-tensor fields as verl passes them to the agent loop (data_source, reward_model, ...).
    Stored as JSON: timestamps and dates as ISO 8601 text, decimals as their digits, binary as base64."""
    extra_fields: dict[str, Any] = field(default_factory=dict)
    """The agent loop's `extra_fields` (turn_scores, tool_rewards, raw_prompt, ...)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """verl's AgentLoopMetrics for this trajectory (timings in seconds)."""
    provenance: dict[str, Any] | None = None
    """Where and how it was made (PROVENANCE_KEYS); None in parts written before genrun kept it."""
    timings: dict[str, float | None] | None = None
    """Its time split (TIMINGS), seconds; None in parts written before genrun kept it."""
    images: list[bytes] | None = None
    """The prompt's images as the model got them (resized), PNG; None: text only."""

    def __post_init__(self) -> None:
        # Every record, built by an agent loop or read from a part (older parts may hold NaN).
        self.reward_score = score_or_none(self.reward_score)

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
    traceback: str = ""
    """Where it failed: the Python traceback (an engine's, raised in a Ray actor, included), its
    last TRACEBACK_CHARS characters."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.index, self.rollout_n)

    @classmethod
    def from_exception(cls, key: tuple[int, int], exc: BaseException) -> SampleFailure:
        # Ray wraps an actor's exception; its own text starts with the actor's name, not the error.
        cause = getattr(exc, "cause", None) or exc
        message = str(cause).strip().splitlines()
        return cls(
            key[0], key[1], f"{type(cause).__name__}: {message[0] if message else ''}"[:2000], _traceback_text(exc)
        )


TRACEBACK_CHARS = 20_000


def _traceback_text(exc: BaseException) -> str:
    """The traceback of `exc`: for an exception Ray raised on behalf of an actor, the actor's
    traceback (which Ray carries as text) follows the local one."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    remote = getattr(exc, "traceback_str", None)
    if isinstance(remote, str) and remote.strip() and remote.strip() not in text:
        text = f"{text}\n{remote.rstrip()}"
    # The end holds the frame that raised: keep it when the text is long.
    return text[-TRACEBACK_CHARS:]


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
    # Dataset columns JSON has no type for (Parquet timestamp, date, time, decimal, binary) are
    # carried as text, so such a column never fails a shard after its samples were generated:
    # ISO 8601, the decimal's digits, base64.
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"cannot store a {type(value).__name__} in a trajectory record")


# Chosen on parts of real generations (bench/RESULTS.md history, issue 6 storage). Statistics and the embedded Arrow
# schema are per-file overhead that a small part pays in full and nothing reads (the reader
# casts to PART_SCHEMA). Dictionary pages only add bytes here: token ids, logprobs and JSON
# rows are nearly all distinct within a part. BYTE_STREAM_SPLIT stores byte 0 of every value,
# then byte 1, ...: the high bytes of token ids (< 2^24) and the sign/exponent bytes of floats
# become long runs zstd shrinks (lossless; readers need Parquet format 2.11, pyarrow >= 17).
# zstd level 6: level 9 is no smaller on these parts, 19 is ~2% smaller but ~15x slower.
_BYTE_STREAM_SPLIT = (
    "prompt_ids.list.element",
    "response_ids.list.element",
    "response_logprobs.list.element",
    "reward_score",
    *(f"seconds_{name}" for name in TIMINGS),
)
_PARQUET_OPTIONS = dict(
    compression="zstd",
    compression_level=6,
    write_statistics=False,
    store_schema=False,
    use_dictionary=False,
    column_encoding={column: "BYTE_STREAM_SPLIT" for column in _BYTE_STREAM_SPLIT},
)


def score_or_none(score: Any) -> float | None:
    """The one rule for rewards everywhere: a NaN score is no score (None). Parts written before
    the rule may hold NaN; every reader goes through this (or `scored_mask`)."""
    if score is None:
        return None
    score = float(score)
    return None if score != score else score


def scored_mask(column: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """Per row of a `reward_score` column, whether it holds a score (not null, not NaN)."""
    return pc.and_kleene(pc.is_valid(column), pc.invert(pc.is_nan(column))).fill_null(False)


def records_to_table(records: list[TrajectoryRecord]) -> pa.Table:
    shared = [_shares_raw_prompt(r) for r in records]
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
        "extra_fields": [
            to_json({k: v for k, v in r.extra_fields.items() if k != SHARED_RAW_PROMPT} if s else r.extra_fields)
            for r, s in zip(records, shared, strict=True)
        ],
        "metrics": [to_json(r.metrics) for r in records],
        "raw_prompt_shared": shared,
        "provenance": [None if r.provenance is None else to_json(r.provenance) for r in records],
    }
    for name in TIMINGS:
        columns[f"seconds_{name}"] = [None if r.timings is None else r.timings.get(name) for r in records]
    columns["image_digests"], columns["image_bytes"] = _image_columns(records)
    return pa.table(columns, schema=PART_SCHEMA)


def _image_columns(records: list[TrajectoryRecord]) -> tuple[list, list]:
    """Per record: the digests of its images, and the bytes of those no earlier record here holds."""
    digests: list[list[str] | None] = []
    payloads: list[list[bytes] | None] = []
    seen: set[str] = set()
    for record in records:
        names = None if record.images is None else [hashlib.sha256(data).hexdigest() for data in record.images]
        digests.append(names)
        payloads.append(None if names is None else [])
        for name, data in zip(names or [], record.images or [], strict=True):
            if name not in seen:
                seen.add(name)
                payloads[-1].append(data)  # type: ignore[union-attr]  # a list when names is one
    return digests, payloads


def decode_images(table: pa.Table) -> list[list[bytes] | None]:
    """Each row's images (None: text only), resolved within the table (a part read whole)."""
    names = table.column("image_digests").to_pylist()
    rows = table.column("image_bytes").to_pylist()
    store = {hashlib.sha256(data).hexdigest(): data for row in rows for data in row or []}
    return [None if row is None else [store[name] for name in row] for row in names]


def _shares_raw_prompt(record: TrajectoryRecord) -> bool:
    if SHARED_RAW_PROMPT not in record.extra_fields or SHARED_RAW_PROMPT not in record.input_fields:
        return False
    extra, given = record.extra_fields[SHARED_RAW_PROMPT], record.input_fields[SHARED_RAW_PROMPT]
    # The same object in the streaming path; otherwise compared as stored, since the reader
    # restores what JSON gives back (1, 1.0 and True are equal in Python, not in JSON).
    return extra is given or to_json(extra) == to_json(given)


def records_to_parquet(records: list[TrajectoryRecord]) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(records_to_table(records), buffer, **_PARQUET_OPTIONS)
    return buffer.getvalue()


def part_parquet_writer(sink) -> pq.ParquetWriter:
    """A Parquet writer of one part onto `sink` (a file-like object), with the options of
    `records_to_parquet`: each `write_table(records_to_table(batch))` appends a row group, so a
    part is streamed out a batch at a time instead of held whole. Closing it writes the footer
    and leaves `sink` open."""
    return pq.ParquetWriter(sink, PART_SCHEMA, **_PARQUET_OPTIONS)


def read_part_table(data: bytes, columns: list[str] | None = None) -> pa.Table:
    """A part's columns as an Arrow table with PART_SCHEMA's types, whichever version wrote it
    (an older part lacks `raw_prompt_shared`: it reads as all false; `provenance` and the
    timings: null)."""
    part = pq.ParquetFile(io.BytesIO(data))
    stored = set(part.schema_arrow.names)
    wanted = list(PART_SCHEMA.names) if columns is None else list(columns)
    table = part.read(columns=[name for name in wanted if name in stored])
    arrays = []
    for name in wanted:
        field_type = PART_SCHEMA.field(name).type
        if name in stored:
            arrays.append(table.column(name).cast(field_type))
        elif name == "raw_prompt_shared":
            arrays.append(pa.chunked_array([pa.array([False] * table.num_rows, pa.bool_())]))
        elif PART_SCHEMA.field(name).nullable and name in OPTIONAL_COLUMNS:
            arrays.append(pa.chunked_array([pa.nulls(table.num_rows, field_type)]))
        else:
            raise ValueError(f"part has no column {name!r}")
    return pa.Table.from_arrays(arrays, names=wanted)


OPTIONAL_COLUMNS = frozenset(["provenance", *(f"seconds_{name}" for name in TIMINGS), "image_digests", "image_bytes"])
"""Columns later genruns added: a part without them reads them as null."""


def decode_provenance(table: pa.Table) -> tuple[list[dict[str, Any] | None], list[dict[str, float | None] | None]]:
    """(provenance, timings) of every row of a part table read with those columns; None for a
    row written before genrun kept them."""
    provenance = [None if text is None else json.loads(text) for text in table.column("provenance").to_pylist()]
    seconds = {name: table.column(f"seconds_{name}").to_pylist() for name in TIMINGS}
    timings: list[dict[str, float | None] | None] = []
    for row, known in enumerate(provenance):
        values = {name: seconds[name][row] for name in TIMINGS}
        timings.append(None if known is None and all(v is None for v in values.values()) else values)
    return provenance, timings


def decode_fields(table: pa.Table) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(input_fields, extra_fields, metrics) of every row of a part table, with a shared raw
    prompt put back into extra_fields (a copy: the two dicts must not alias)."""
    inputs = [json.loads(text) for text in table.column("input_fields").to_pylist()]
    extras = [json.loads(text) for text in table.column("extra_fields").to_pylist()]
    metrics = [json.loads(text) for text in table.column("metrics").to_pylist()]
    for fields, extra, shared in zip(inputs, extras, table.column("raw_prompt_shared").to_pylist(), strict=True):
        if shared:
            extra[SHARED_RAW_PROMPT] = copy.deepcopy(fields[SHARED_RAW_PROMPT])
    return inputs, extras, metrics


def records_from_parquet(data: bytes) -> list[TrajectoryRecord]:
    return records_of_table(read_part_table(data))


# The part columns a record carries as they are (one value per trajectory): what the merge reads
# besides the encoded fields, and what records_of_table turns back into records.
TOKEN_COLUMNS = (
    "index",
    "rollout_n",
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "reward_score",
    "num_turns",
)


def records_of_table(table: pa.Table) -> list[TrajectoryRecord]:
    """The records of a part table read with every column (`read_part_table(data)`)."""
    inputs, extras, metrics = decode_fields(table)
    provenance, timings = decode_provenance(table)
    columns, images = {name: table.column(name).to_pylist() for name in TOKEN_COLUMNS}, decode_images(table)
    return [
        TrajectoryRecord(
            index=columns["index"][row],
            rollout_n=columns["rollout_n"][row],
            prompt_ids=columns["prompt_ids"][row],
            response_ids=columns["response_ids"][row],
            response_mask=columns["response_mask"][row],
            response_logprobs=columns["response_logprobs"][row],
            reward_score=columns["reward_score"][row],
            num_turns=columns["num_turns"][row],
            input_fields=inputs[row],
            extra_fields=extras[row],
            metrics=metrics[row],
            provenance=provenance[row],
            timings=timings[row],
            images=images[row],
        )
        for row in range(table.num_rows)
    ]
