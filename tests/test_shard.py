"""Shard mechanics with a scripted agent loop (no model): streaming, bounded in-flight,
parts cut by age, resume after a failure, and the success marker. The real-model path is
covered by test_run_e2e and test_crash_resume."""

import asyncio
import json

import pytest

from generation_core.config.loading import load_config
from generation_core.inputs.shard_rows import ShardSpec
from generation_core.shard.attempt import TooManyFailedSamples
from generation_core.shard.sample_stream import SampleStream
from generation_core.store.commit_log import read_failure_log
from generation_core.store.folder import StorageFolder
from generation_core.store.trajectory_record import TrajectoryRecord
from tests.merge_oracles import read_committed_records
from tests.run_folder_helpers import checkpoint_dict, committed_keys
from tests.sample_deadline import failure_log
from tests.shard_runs import run_shard

pytestmark = pytest.mark.timeout(120)


class FakePrompts:
    """A shard's prompts (shard/protocols.py's ShardPrompts): dataset row p has sample id 100 + p;
    none filtered; no rows digest unless a test sets one."""

    filtered_overlong = 0
    rows_digest = None

    def __init__(self, shard):
        self.start, self.num_rows = shard.start, len(shard)
        self.dispatch_rows = range(self.num_rows)

    def __len__(self):
        return self.num_rows

    def row_index(self, row):
        return 100 + self.start + row

    def keeps(self, row):
        return True

    def row_kwargs(self, row):
        row = self.start + row
        return {
            "index": 100 + row,
            "agent_name": "single_turn_agent",
            "raw_prompt": [{"role": "user", "content": str(row)}],
        }

    sample_index, agent_kwargs = row_index, row_kwargs


class ScriptedWorker:
    """A StreamWorker (shard/protocols.py) with the product's streaming (SampleStream: slots,
    deadlines); only the per-sample agent loop is scripted. `sample_timeout`: each sample's
    deadline (generation.sample_timeout_seconds)."""

    postprocess_seconds = 0.0

    def __init__(self, delays=None, fail_on=None, sample_timeout=float("inf")):
        self.delays = delays or {}
        self.fail_on = fail_on
        self.started: list[tuple[int, int]] = []
        self.inflight = 0
        self.max_seen_inflight = 0
        self.provenance = {}
        self.samples = SampleStream(self.run_one, sample_timeout)

    def stream(self, samples, max_inflight, idle_timeout, max_open=None, scale=None):
        return self.samples.stream(samples, max_inflight, idle_timeout, max_open, scale)

    @property
    def peak_calls_in_flight(self):
        return self.samples.peak_calls_in_flight

    def engine_counters(self):
        return {"requests": 0, "request_retries": 0, "replica_failures": 0}

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
    folder = StorageFolder(str(tmp_path))
    worker = ScriptedWorker()
    manifest = run_shard(cfg, ShardSpec(0, 0, 5), folder, FakePrompts(ShardSpec(0, 0, 5)), worker)
    assert worker.max_seen_inflight <= 3
    assert manifest.num_trajectories == 10 == manifest.expected_trajectories
    assert [p.count for p in manifest.parts] == [4, 4, 2]
    keys = [r.key for r in read_committed_records(folder)]
    assert keys == [(100 + p, n) for p in range(5) for n in range(2)]
    assert (
        json.loads((tmp_path / "shards" / "shard-00000" / "_SUCCESS.json").read_text())["parts"]
        == manifest.to_dict()["parts"]
    )


def test_part_max_seconds_commits_a_partial_part(tmp_path):
    cfg = _cfg("generation.save_batch_size=100", "generation.part_max_seconds=0.3", "generation.max_inflight=4")
    folder = StorageFolder(str(tmp_path))
    worker = ScriptedWorker(delays={103: 1.5})
    manifest = run_shard(cfg, ShardSpec(0, 0, 4), folder, FakePrompts(ShardSpec(0, 0, 4)), worker)
    assert [p.count for p in manifest.parts] == [3, 1], "the three fast samples were committed while the slow one ran"


def test_the_first_part_is_cut_young_and_later_parts_by_part_max_seconds(tmp_path):
    cfg = _cfg("generation.part_max_seconds=100", "generation.first_part_max_seconds=0.3", "generation.max_inflight=4")
    worker = ScriptedWorker(delays={102: 1.0, 103: 1.0})
    manifest = run_shard(cfg, ShardSpec(0, 0, 4), StorageFolder(str(tmp_path)), FakePrompts(ShardSpec(0, 0, 4)), worker)
    assert [p.count for p in manifest.parts] == [2, 2], (
        "the first part went out 0.3 s after its first trajectory; the second waited for the end"
    )


def test_failed_sample_is_recorded_the_shard_carries_on_and_a_retry_regenerates_only_it(tmp_path):
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    folder = StorageFolder(str(tmp_path))
    shard_dir = tmp_path / "shards" / "shard-00000"
    with pytest.raises(TooManyFailedSamples, match=r"1 of 6 trajectories failed.*max_failed_fraction=0.0"):
        run_shard(cfg, ShardSpec(0, 0, 6), folder, FakePrompts(ShardSpec(0, 0, 6)), ScriptedWorker(fail_on=(104, 0)))
    checkpoint = checkpoint_dict(tmp_path)
    assert checkpoint["completed"] == ["100:0", "101:0", "102:0", "103:0", "105:0"], (
        "the shard carried on past the failure"
    )
    assert checkpoint["failed"] == ["104:0"]
    [failure] = read_failure_log(folder, "shard-00000")
    assert (
        failure["sample"] == "104:0"
        and failure["error"] == "RuntimeError: scripted failure for (104, 0)"
        and failure["attempt"] == 1
    )
    assert "Traceback" in failure["traceback"] and "scripted failure" in failure["traceback"], "where it failed is kept"
    assert not (shard_dir / "_SUCCESS.json").exists()
    assert "TooManyFailedSamples" in json.loads((shard_dir / "last_error.json").read_text())["error"]

    retry = ScriptedWorker()
    manifest = run_shard(cfg, ShardSpec(0, 0, 6), folder, FakePrompts(ShardSpec(0, 0, 6)), retry)
    assert retry.started == [(104, 0)], "only the failed sample runs again"
    assert manifest.attempts == 2 and manifest.num_trajectories == 6 and manifest.failures == 0
    assert [r.key for r in read_committed_records(folder)] == [(100 + p, 0) for p in range(6)]

    done = ScriptedWorker()
    again = run_shard(cfg, ShardSpec(0, 0, 6), folder, FakePrompts(ShardSpec(0, 0, 6)), done)
    assert done.started == [] and again.last_attempt.skipped


def test_an_agent_loop_that_never_returns_fails_its_sample_at_the_deadline_and_frees_its_slot(tmp_path):
    cfg = _cfg(
        "generation.max_inflight=1", "generation.max_failed_fraction=0.5", "generation.sample_timeout_seconds=0.5"
    )
    worker = ScriptedWorker(  # 102: asyncio.sleep for ever
        delays={102: 10**6}, sample_timeout=cfg.generation.sample_timeout_seconds
    )
    shard = ShardSpec(0, 0, 5)
    manifest = run_shard(cfg, shard, StorageFolder(str(tmp_path)), FakePrompts(shard), worker)
    assert worker.started == [(100 + p, 0) for p in range(5)], (
        "one slot: the samples after 102 ran only because its deadline freed it"
    )
    assert worker.inflight == 0, "the hung sample was cancelled"
    assert manifest.num_trajectories == 4 and manifest.failed_samples == ["102:0"]
    [failure] = failure_log(tmp_path / "shards" / "shard-00000")
    assert failure["error"] == (
        "SampleTimedOut: sample 102:0 did not finish within generation.sample_timeout_seconds=0.5 s (an agent loop, tool or "
        "reward function that does not return?) and was cancelled; raise generation.sample_timeout_seconds if its samples need longer"
    )
    assert "in run_one" in failure["traceback"] and "asyncio.sleep" in failure["traceback"], "where it was waiting"


def test_failures_within_max_failed_fraction_finish_the_shard_and_a_later_run_retries_them(tmp_path):
    cfg = _cfg(
        "generation.save_batch_size=3",
        "generation.max_inflight=2",
        "actor_rollout_ref.rollout.n=2",
        "generation.max_failed_fraction=0.1",
    )
    folder = StorageFolder(str(tmp_path))
    shard = ShardSpec(0, 0, 10)
    manifest = run_shard(cfg, shard, folder, FakePrompts(shard), ScriptedWorker(fail_on=(107, 1)))
    assert manifest.num_trajectories == 19 and manifest.expected_trajectories == 20
    assert manifest.failures == 1 and manifest.failed_samples == ["107:1"]
    marker = json.loads((tmp_path / "shards" / "shard-00000" / "_SUCCESS.json").read_text())
    assert marker["failures"] == 1
    assert (107, 1) not in {r.key for r in read_committed_records(folder)}

    # The same run again: the finished shard is re-opened for its failed sample only.
    rerun = ScriptedWorker()
    manifest = run_shard(cfg, shard, folder, FakePrompts(shard), rerun)
    assert rerun.started == [(107, 1)]
    assert manifest.failures == 0 and manifest.num_trajectories == 20
    keys = [r.key for r in read_committed_records(folder)]
    assert keys == [(100 + p, n) for p in range(10) for n in range(2)]
    log = read_failure_log(folder, "shard-00000")
    assert len(log) == 1, "the history of failures is kept"


def test_more_failures_than_allowed_fail_the_shard(tmp_path):
    cfg = _cfg("generation.save_batch_size=4", "generation.max_inflight=2", "generation.max_failed_fraction=0.25")
    folder = StorageFolder(str(tmp_path))

    class FailingTwo(ScriptedWorker):
        async def run_one(self, key, kwargs):
            if key[0] in (101, 106):
                raise ConnectionError(f"engine unreachable for {key}")
            return await super().run_one(key, kwargs)

    # 8 trajectories, 0.25 allows 2: two failures pass.
    manifest = run_shard(cfg, ShardSpec(0, 0, 8), folder, FakePrompts(ShardSpec(0, 0, 8)), FailingTwo())
    assert manifest.failures == 2 and manifest.num_trajectories == 6

    class FailingThree(ScriptedWorker):
        async def run_one(self, key, kwargs):
            if key[0] in (101, 104, 106):
                raise ConnectionError(f"engine unreachable for {key}")
            return await super().run_one(key, kwargs)

    other = StorageFolder(str(tmp_path / "other"))
    with pytest.raises(TooManyFailedSamples, match="3 of 8 trajectories failed"):
        run_shard(cfg, ShardSpec(0, 0, 8), other, FakePrompts(ShardSpec(0, 0, 8)), FailingThree())
    checkpoint = checkpoint_dict(tmp_path / "other")
    assert len(checkpoint["completed"]) == 5 and sorted(checkpoint["failed"]) == ["101:0", "104:0", "106:0"]


def test_systematic_failures_stop_the_shard_early(tmp_path):
    cfg = _cfg("generation.save_batch_size=4", "generation.max_inflight=2")

    class EngineDown(ScriptedWorker):
        async def run_one(self, key, kwargs):
            self.started.append(key)
            raise ConnectionError("engine down")

    worker = EngineDown()
    with pytest.raises(TooManyFailedSamples):
        run_shard(cfg, ShardSpec(0, 0, 50), StorageFolder(str(tmp_path)), FakePrompts(ShardSpec(0, 0, 50)), worker)
    assert len(worker.started) < 10, "gave up after 2 x max_inflight failures instead of failing all 50"


def test_n_samples_resume_regenerates_only_the_missing_rollouts(tmp_path):
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1", "actor_rollout_ref.rollout.n=4")
    folder = StorageFolder(str(tmp_path))

    class StopAfter(ScriptedWorker):
        async def run_one(self, key, kwargs):
            if key == (100, 2):
                raise KeyboardInterrupt  # a crash: not a sample failure, the attempt dies
            return await super().run_one(key, kwargs)

    with pytest.raises(KeyboardInterrupt):
        run_shard(cfg, ShardSpec(0, 0, 3), folder, FakePrompts(ShardSpec(0, 0, 3)), StopAfter())
    assert committed_keys(tmp_path, "shard-00000") == ["100:0", "100:1"]
    resumed = ScriptedWorker()
    manifest = run_shard(cfg, ShardSpec(0, 0, 3), folder, FakePrompts(ShardSpec(0, 0, 3)), resumed)
    assert resumed.started[:2] == [(100, 2), (100, 3)], "the prompt with 2 of 4 done regenerates only 2"
    assert len(resumed.started) == 10 and manifest.num_trajectories == 12
    keys = [r.key for r in read_committed_records(folder)]
    assert keys == [(100 + p, n) for p in range(3) for n in range(4)] and len(set(keys)) == 12


def test_status_reports_done_failed_and_pending_shards(tmp_path, capsys):
    from generation_core.outputs.status import print_status

    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    folder = StorageFolder(str(tmp_path))
    shards = [ShardSpec(0, 0, 4), ShardSpec(1, 4, 8), ShardSpec(2, 8, 12)]
    folder.put_json(
        "run.json",
        {
            "fingerprint": "f" * 64,
            "rollout_n": 1,
            "shards": [{"name": s.name, "range": [s.start, s.end]} for s in shards],
        },
    )
    run_shard(cfg, shards[0], folder, FakePrompts(shards[0]), ScriptedWorker())
    with pytest.raises(TooManyFailedSamples):
        run_shard(cfg, shards[1], folder, FakePrompts(shards[1]), ScriptedWorker(fail_on=(107, 0)))
    assert print_status(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "shard-00000  done     4/4" in out
    assert (
        "shard-00001  failed   3/4  1 failed sample(s), see shards/shard-00001/failures/  last error: TooManyFailedSamples: shard-00001: 1 of 4 trajectories failed"
        in out
    )
    assert "shard-00002  pending  0/4" in out
    assert "shards: 1 done, 0 running or interrupted, 1 failed, 1 pending; trajectories 7/12; failed samples 1" in out
