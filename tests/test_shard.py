"""Shard mechanics with a scripted agent loop (no model): streaming, bounded in-flight,
pull_timeout parts, resume after a failure, and the success marker. The real-model path is
covered by test_run_e2e and test_crash_resume."""

import asyncio
import json

import pytest

from generation_core.config import load_config
from generation_core.data import ShardSpec
from generation_core.merge import read_committed_records
from generation_core.records import TrajectoryRecord
from generation_core.shard import run_shard
from generation_core.storage import RunFolder
from generation_core.streaming import StreamingWorker

pytestmark = pytest.mark.timeout(120)


class FakePrompts:
    """Dataset position p has sample id 100 + p."""

    def sample_index(self, position):
        return 100 + position

    def agent_kwargs(self, position):
        return {"index": 100 + position, "agent_name": "single_turn_agent", "raw_prompt": [{"role": "user", "content": str(position)}]}


class ScriptedWorker(StreamingWorker):
    """The real streaming logic; only the per-sample agent loop is scripted."""

    def __init__(self, delays=None, fail_on=None):
        self.delays = delays or {}
        self.fail_on = fail_on
        self.started: list[tuple[int, int]] = []
        self.inflight = 0
        self.max_seen_inflight = 0

    async def run_one(self, key, kwargs):
        self.started.append(key)
        self.inflight += 1
        self.max_seen_inflight = max(self.max_seen_inflight, self.inflight)
        try:
            await asyncio.sleep(self.delays.get(key[0], 0.001))
            if key == self.fail_on:
                raise RuntimeError(f"scripted failure for {key}")
            return TrajectoryRecord(key[0], key[1], [1, 2], [10 + key[1], 2], [1, 1], None, None, 2, kwargs, {}, {})
        finally:
            self.inflight -= 1


def _cfg(*extra):
    return load_config(["generation.show_progress=false", *extra])


def test_parts_stream_out_and_in_flight_is_bounded(tmp_path):
    cfg = _cfg("generation.save_batch_size=4", "generation.max_inflight=3", "actor_rollout_ref.rollout.n=2")
    folder = RunFolder(str(tmp_path))
    worker = ScriptedWorker()
    manifest = asyncio.run(run_shard(cfg, ShardSpec(0, 0, 5), folder, FakePrompts(), worker))
    assert worker.max_seen_inflight <= 3
    assert manifest["num_trajectories"] == 10 == manifest["expected_trajectories"]
    assert [p["count"] for p in manifest["parts"]] == [4, 4, 2]
    keys = [r.key for r in read_committed_records(folder)]
    assert keys == [(100 + p, n) for p in range(5) for n in range(2)]
    assert json.loads((tmp_path / "shards" / "shard-00000" / "_SUCCESS.json").read_text())["parts"] == manifest["parts"]


def test_pull_timeout_commits_a_partial_part(tmp_path):
    cfg = _cfg("generation.save_batch_size=100", "generation.pull_timeout=0.3", "generation.max_inflight=4")
    folder = RunFolder(str(tmp_path))
    worker = ScriptedWorker(delays={103: 1.5})
    manifest = asyncio.run(run_shard(cfg, ShardSpec(0, 0, 4), folder, FakePrompts(), worker))
    assert [p["count"] for p in manifest["parts"]] == [3, 1], "the three fast samples were committed while the slow one ran"


def test_failed_shard_resumes_from_its_checkpoint(tmp_path):
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    folder = RunFolder(str(tmp_path))
    with pytest.raises(RuntimeError, match="scripted failure"):
        asyncio.run(run_shard(cfg, ShardSpec(0, 0, 6), folder, FakePrompts(), ScriptedWorker(fail_on=(104, 0))))
    checkpoint = json.loads((tmp_path / "shards" / "shard-00000" / "checkpoint.json").read_text())
    assert checkpoint["completed"] == ["100:0", "101:0", "102:0", "103:0"]
    assert not (tmp_path / "shards" / "shard-00000" / "_SUCCESS.json").exists()

    retry = ScriptedWorker()
    manifest = asyncio.run(run_shard(cfg, ShardSpec(0, 0, 6), folder, FakePrompts(), retry))
    assert retry.started == [(104, 0), (105, 0)], "only uncommitted samples run again"
    assert manifest["attempts"] == 2 and manifest["num_trajectories"] == 6
    assert [r.key for r in read_committed_records(folder)] == [(100 + p, 0) for p in range(6)]

    done = ScriptedWorker()
    again = asyncio.run(run_shard(cfg, ShardSpec(0, 0, 6), folder, FakePrompts(), done))
    assert done.started == [] and again["last_attempt"]["skipped"]


def test_status_reports_done_failed_and_pending_shards(tmp_path, capsys):
    from generation_core.status import print_status

    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    folder = RunFolder(str(tmp_path))
    shards = [ShardSpec(0, 0, 4), ShardSpec(1, 4, 8), ShardSpec(2, 8, 12)]
    folder.put_json("run.json", {"fingerprint": "f" * 64, "rollout_n": 1, "shards": [{"name": s.name, "range": [s.start, s.end]} for s in shards]})
    asyncio.run(run_shard(cfg, shards[0], folder, FakePrompts(), ScriptedWorker()))
    with pytest.raises(RuntimeError):
        asyncio.run(run_shard(cfg, shards[1], folder, FakePrompts(), ScriptedWorker(fail_on=(107, 0))))
    assert print_status(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "shard-00000  done     4/4" in out
    assert "shard-00001  failed   2/4  last error: RuntimeError: scripted failure for (107, 0)" in out
    assert "shard-00002  pending  0/4" in out
    assert "shards: 1 done, 0 running or interrupted, 1 failed, 1 pending; trajectories 6/12" in out
