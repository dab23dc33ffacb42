"""run.json through its typed record (generation_core/store/run_record.py): written exactly as before,
read leniently (a run.json of an earlier genrun lacks keys added since)."""

from __future__ import annotations

import json

import pytest

from generation_core.errors import GenrunError
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import RUN_FILE, read_run_record
from generation_core.store.run_record import RunRecord, ShardRange

pytestmark = pytest.mark.timeout(60)

FULL = {
    "fingerprint": "f" * 64,
    "fingerprint_version": 3,
    "versions": {"genrun": "0.1.0", "verl": "0.9.1"},
    "build": {"version": "0.1.0", "commit": "a" * 40, "dirty": False, "output_format": 1},
    "pad_token_id": 2,
    "shards": [{"name": "shard-00000", "range": [0, 5]}, {"name": "shard-00001", "range": [5, 9]}],
    "dataset": {"files": [{"url": "/data/p.parquet"}]},
    "rollout_n": 4,
    "created": "2026-11-26T12:00:00Z",
    "config": {"actor_rollout_ref": {"rollout": {"n": 4, "prompt_length": 8}}, "generation": {"num_shards": 2}},
    "settings": {"num_shards": 2, "max_inflight": 128},
}


def test_a_full_run_json_reads_and_writes_back_byte_for_byte():
    record = RunRecord.from_json(json.loads(json.dumps(FULL)))
    assert record.shards[1] == ShardRange("shard-00001", 5, 9) and record.shards[1].rows == 4
    assert json.dumps(record.to_json()) == json.dumps(FULL), "the same keys in the same order"


def test_an_earlier_run_json_reads_with_its_absent_keys_as_none(tmp_path):
    folder = StorageFolder(str(tmp_path))
    folder.put_json(
        RUN_FILE,
        {
            "fingerprint": "e" * 64,
            "pad_token_id": 0,
            "shards": [{"name": "shard-00000", "range": [0, 3]}],
            "config": {"actor_rollout_ref": {"rollout": {"n": 2}}},
        },
    )
    record = read_run_record(folder)
    assert record.fingerprint_version == 1, "no fingerprint_version: recipe 1"
    assert (record.build, record.created, record.rollout_n, record.versions, record.settings) == (
        None,
        None,
        None,
        {},
        None,
    )
    assert record.samples_per_prompt == 2, "rollout_n absent: the config's rollout.n"


def test_a_folder_without_run_json_is_refused(tmp_path):
    with pytest.raises(GenrunError, match="is not a genrun run folder"):
        read_run_record(StorageFolder(str(tmp_path)))
