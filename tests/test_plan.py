"""The plan's one JSON shape on its way to the shard tasks (issue 32, item 2): the flow hands
every shard task the same JSON text, and the driver parses it once per flow run for the shard
cache keys (tasks/run_shard.run_identity), not once per shard; the keys keep their form, so a
flow run finds the shards an earlier genrun cached."""

from __future__ import annotations

import hashlib
import json

import pytest

pytestmark = pytest.mark.timeout(60)


def test_shard_cache_keys_parse_the_plan_once_per_run(tmp_path):
    from tasks.run_shard import run_identity, shard_cache_key

    folder = str(tmp_path / "run")
    plan = json.dumps(
        {
            "config": {"trainer": {"default_local_dir": folder}},
            "fingerprint": "a" * 64,
            "shards": [],
            "pad_token_id": 0,
            "dataset": {"files": [], "num_rows": 0},
        }
    )
    run_identity.cache_clear()
    keys = [
        shard_cache_key(None, {"plan": plan, "shard": {"shard_id": shard_id, "start": 0, "end": 1}})
        for shard_id in range(3)
    ]
    # The form earlier genruns wrote: a resumed flow run finds their cached shards.
    assert keys == [
        f"genrun-{'a' * 24}-{hashlib.sha256(folder.encode()).hexdigest()[:16]}-shard-{shard_id:05d}"
        for shard_id in range(3)
    ]
    assert run_identity.cache_info().misses == 1
