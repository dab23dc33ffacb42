"""Part files: what is written reads back exactly (logprobs bit for bit), the raw prompt is
stored once, and parts written before that change still read."""

import io
import json
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from generation_core.outputs.padding import RUN_DEPENDENT_KEYS
from generation_core.store.trajectory_record import (
    OPTIONAL_COLUMNS,
    PART_SCHEMA,
    TrajectoryRecord,
    read_part_table,
    records_from_parquet,
    records_to_parquet,
)

pytestmark = pytest.mark.timeout(30)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? Ünïcödé ✓"}]


def _record(index: int, logprobs: list[float] | None, **extra) -> TrajectoryRecord:
    return TrajectoryRecord(
        index=index,
        rollout_n=1,
        prompt_ids=[1, 50000, 7, 49151],
        response_ids=[4, 5, 6, 2],
        response_mask=[1, 0, 0, 1],
        response_logprobs=logprobs,
        reward_score=0.75,
        num_turns=4,
        input_fields={
            "data_source": "x",
            "index": index,
            "raw_prompt": MESSAGES,
            "reward_model": {"ground_truth": "4"},
        },
        extra_fields={
            "raw_prompt": MESSAGES,
            "turn_scores": [0.1],
            "tool_rewards": [],
            "reward_extra_info": {"acc": True, "pred": "4", "score": 0.75},
            **extra,
        },
        metrics={"generate_sequences": 0.123456789012345, "tool_calls": 0.0, "num_preempted": -1},
    )


def _bits(values: list[float]) -> bytes:
    return b"".join(struct.pack("<f", v) for v in values)


def test_parts_round_trip_exactly_with_logprobs_bit_for_bit():
    # float32 values as the engine hands them over, edge cases included.
    tricky = [float(v) for v in np.array([-1e-45, -0.0, -3.4028235e38, -1.2345678e-7], dtype=np.float32)]
    random = [float(v) for v in (-np.abs(np.random.default_rng(0).normal(0, 3, 4))).astype(np.float32)]
    records = [
        _record(3, tricky),
        _record(4, random),
        _record(5, None, raw_prompt=[{"role": "user", "content": "a different prompt"}]),
        TrajectoryRecord(6, 0, [7], [], [], None, None, 2, {}, {}, {}),
    ]
    back = records_from_parquet(records_to_parquet(records))
    assert [r.__dict__ for r in back] == [r.__dict__ for r in records]
    assert _bits(back[0].response_logprobs) == _bits(tricky) and _bits(back[1].response_logprobs) == _bits(random)
    # Restored raw prompts are copies: editing one field dict leaves the other alone.
    back[0].extra_fields["raw_prompt"].append({"role": "assistant", "content": "4"})
    assert back[0].input_fields["raw_prompt"] == MESSAGES


def test_provenance_and_timings_round_trip_and_a_part_without_them_reads_none():
    provenance = {
        "engine": "hf",
        "engine_version": "5.10.4",
        "model_digest": "ab" * 32,
        "seed": 7,
        "sampling_digest": "0123456789abcdef",
        "attempt": 2,
        "retries": 1,
        "started_at": 1764000000.25,
        "turns": [
            {
                "replica": "r0",
                "stop_reason": "stop",
                "start": 0.0,
                "seconds": 0.5,
                "tokens": 4,
                "slot_wait": 0.25,
                "prefill": 0.125,
                "prefix_hit": False,
            }
        ],
    }
    timed = _record(3, None)
    timed.provenance = provenance
    timed.timings = {"slot_wait": 0.25, "prefill": None, "decode": 1.5, "tools": 0.0, "reward": None}
    back = records_from_parquet(records_to_parquet([timed, _record(4, None)]))
    assert back[0].provenance == provenance and back[0].timings == timed.timings
    assert back[1].provenance is None and back[1].timings is None


def test_the_raw_prompt_is_stored_once_when_both_field_dicts_hold_it():
    records = [_record(3, None), _record(5, None, raw_prompt=[{"role": "user", "content": "a different prompt"}])]
    table = pq.read_table(io.BytesIO(records_to_parquet(records)))
    extras = [json.loads(text) for text in table.column("extra_fields").to_pylist()]
    assert "raw_prompt" not in extras[0] and extras[1]["raw_prompt"] == [
        {"role": "user", "content": "a different prompt"}
    ]
    assert table.column("raw_prompt_shared").to_pylist() == [True, False]


def test_parts_written_before_the_shared_raw_prompt_still_read(tmp_path):
    record = _record(3, [-0.5, 0.0, 0.0, -0.25])
    # Parts of that time had no provenance or timing columns either: they read as None.
    old_schema = pa.schema(
        [field for field in PART_SCHEMA if field.name != "raw_prompt_shared" and field.name not in OPTIONAL_COLUMNS]
    )
    old_columns = {
        name: [getattr(record, name)]
        for name in (
            "index",
            "rollout_n",
            "prompt_ids",
            "response_ids",
            "response_mask",
            "response_logprobs",
            "reward_score",
            "num_turns",
        )
    }
    old_columns.update(
        {
            name: [json.dumps(getattr(record, name), sort_keys=True)]
            for name in ("input_fields", "extra_fields", "metrics")
        }
    )
    buffer = io.BytesIO()
    pq.write_table(pa.table(old_columns, schema=old_schema), buffer, compression="zstd")
    old_part = buffer.getvalue()
    assert [r.__dict__ for r in records_from_parquet(old_part)] == [record.__dict__]
    assert read_part_table(old_part, ["index", "raw_prompt_shared"]).to_pylist() == [
        {"index": 3, "raw_prompt_shared": False}
    ]
    # And the merge reads such a part next to a new one, the raw prompt in extra_fields alike.
    import hashlib

    from generation_core.outputs.merge import merge_run
    from generation_core.store.commit_log import ShardCheckpoint
    from generation_core.store.folder import StorageFolder
    from generation_core.store.run_folder import PartEntry
    from tests.merge_oracles import build_dataproto, read_committed_records

    folder = StorageFolder(str(tmp_path))
    checkpoint = ShardCheckpoint()
    for name, index, data in (
        ("old.parquet", 3, old_part),
        ("new.parquet", 4, records_to_parquet([_record(4, [-1.0, 0.0, 0.0, -2.0])])),
    ):
        folder.put_atomic(f"shards/shard-00000/{name}", data)
        checkpoint.commit_part(
            folder,
            "shard-00000",
            PartEntry(name=name, count=1, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()),
            [f"{index}:0"],
        )
    merged = merge_run(folder, prompt_length=4, response_length=4, pad_token_id=2)
    expected = build_dataproto(read_committed_records(folder), prompt_length=4, response_length=4, pad_token_id=2)
    assert merged.non_tensor_batch["raw_prompt"].tolist() == [MESSAGES, MESSAGES]
    assert {key: value.tolist() for key, value in merged.non_tensor_batch.items() if key not in RUN_DEPENDENT_KEYS} == {
        key: value.tolist() for key, value in expected.non_tensor_batch.items() if key not in RUN_DEPENDENT_KEYS
    }
