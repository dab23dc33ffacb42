"""Many shards through the flow (issue 16, item 8; bench/RESULTS.md's history has 1,000, this test 12
for CI time: each shard costs about a second of 2 cores): every shard is a Prefect task on Ray
that finishes with its marker, the counts add up exactly, and Ray reuses its worker processes
across shard tasks (imports are paid per worker, not per shard)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import chat_rows, run_genrun, write_parquet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

SHARDS = 12
PROMPTS = 36


def test_twelve_shards_finish_with_every_marker_and_reused_workers(prefect_server, tmp_path):
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(PROMPTS))
    out = tmp_path / "run"
    args = [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        f"generation.num_shards={SHARDS}",
        "generation.show_progress=false",
    ]
    result = run_genrun(args, env=prefect_server.env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trajectories:  {PROMPTS} " in result.stdout

    markers = {path.parent.name: json.loads(path.read_text()) for path in (out / "shards").glob("*/_SUCCESS.json")}
    assert sorted(markers) == [f"shard-{i:05d}" for i in range(SHARDS)]
    assert sorted(m["num_trajectories"] for m in markers.values()) == [PROMPTS // SHARDS] * SHARDS
    summary = json.loads((out / "manifest.json").read_text())
    assert len(summary["shards"]) == SHARDS and sum(s["samples"] for s in summary["shards"]) == PROMPTS

    from verl.protocol import DataProto

    merged = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert merged.non_tensor_batch["index"].tolist() == list(range(PROMPTS))

    pids = {m["last_attempt"]["worker"]["pid"] for m in markers.values()}
    print(f"{SHARDS} shards ran in {len(pids)} Ray worker processes")
    assert len(pids) < SHARDS, "a new Ray worker process per shard task: every shard paid the imports again"
