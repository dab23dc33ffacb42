"""Damaged committed parts (truncated, bit-flipped, deleted) are detected against their
checkpoint, dropped, their samples regenerated exactly once, and the repair is reported. The
whole-CLI case (a part damaged between two `genrun` runs) is one of the chaos suite's faults."""

import pytest

from generation_core.errors import GenrunError
from generation_core.inputs.shard_rows import ShardSpec
from generation_core.outputs.finish import merge_repairing
from generation_core.store.folder import StorageFolder
from tests.merge_oracles import read_committed_records
from tests.run_folder_helpers import checkpoint_dict
from tests.shard_runs import run_shard
from tests.test_shard import FakePrompts, ScriptedWorker, _cfg

pytestmark = pytest.mark.timeout(120)

SHARD = ShardSpec(0, 0, 6)
OWED = sorted(f"{100 + p}:{n}" for p in range(6) for n in range(2))


def _finished_run(tmp_path):
    cfg = _cfg("generation.save_batch_size=4", "generation.max_inflight=2", "actor_rollout_ref.rollout.n=2")
    folder = StorageFolder(str(tmp_path))
    run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    checkpoint = checkpoint_dict(tmp_path)
    assert [p["count"] for p in checkpoint["parts"]] == [4, 4, 4]
    return cfg, folder, checkpoint


def _damage(tmp_path, part, how):
    path = tmp_path / "shards" / "shard-00000" / part["name"]
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "bit flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.unlink()


@pytest.mark.parametrize(
    "how, reason",
    [
        ("truncated", "size .* bytes, checkpoint recorded"),
        ("bit flip", "sha256 does not match"),
        ("deleted", "missing"),
    ],
)
def test_a_damaged_part_is_dropped_and_exactly_its_samples_regenerated(tmp_path, how, reason):
    cfg, folder, before = _finished_run(tmp_path)
    damaged = before["parts"][1]
    lost = before["completed"][4:8]
    _damage(tmp_path, damaged, how)

    worker = ScriptedWorker()
    marker = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), worker)
    assert sorted(f"{i}:{n}" for i, n in worker.started) == sorted(lost), "only the damaged part's samples run again"
    assert len(marker.repaired_parts) == 1
    repair = marker.repaired_parts[0]
    assert repair["name"] == damaged["name"] and repair["samples"] == 4
    assert __import__("re").search(reason, repair["reason"])
    after = checkpoint_dict(tmp_path)
    assert sorted(after["completed"]) == OWED and len(after["completed"]) == len(set(after["completed"]))
    assert (
        after["response_tokens"] == before["response_tokens"]
        and after["generated_tokens"] == before["generated_tokens"]
    )
    records = read_committed_records(folder)
    assert [f"{r.index}:{r.rollout_n}" for r in records] == sorted(OWED, key=lambda k: tuple(map(int, k.split(":"))))


def test_the_driver_size_check_finds_truncation_without_reading_parts_and_writes_nothing(tmp_path, monkeypatch):
    """Issue 44 item 12 / review finding 6: "is this shard finished?" as the flow asks it
    (`finished_shard`) lists the shard's folder once and reads no part: a same-size corruption
    passes it (the job's repair reads every part), a truncated part makes the shard unfinished.
    The answer writes nothing, the damaged part included: the job that runs next repairs it."""
    from generation_core.shard.finished import finished_shard

    _, folder, before = _finished_run(tmp_path)
    read = []
    real_read = StorageFolder.read_bytes
    monkeypatch.setattr(StorageFolder, "read_bytes", lambda self, path: read.append(path) or real_read(self, path))
    _damage(tmp_path, before["parts"][1], "bit flip")
    assert finished_shard(folder, SHARD, rows_digest_now=None) is not None, "a same-size corruption needs the sha256"
    _damage(tmp_path, before["parts"][2], "truncated")
    files = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    assert finished_shard(folder, SHARD, rows_digest_now=None) is None, "the shard has work again"
    assert [path for path in read if path.endswith(".parquet")] == [], "no part was read"
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == files, "nothing written"


def test_a_shard_job_folds_its_commit_log_once_and_repairs_first_saying_what(tmp_path, monkeypatch, caplog):
    """Issue 44 item 12 / review finding 6: an attempt folds the shard's commit records once
    (ShardCheckpoint.load), where it folded them three times (the decision, the attempt record,
    the done record); the repair of a damaged part is the job's first step and logs the part, why
    and what is regenerated; a finished shard's job folds them once too."""
    from generation_core.store import commit_log

    cfg, folder, before = _finished_run(tmp_path)
    _damage(tmp_path, before["parts"][1], "truncated")
    folds = []
    load = commit_log.ShardCheckpoint.load.__func__
    monkeypatch.setattr(
        commit_log.ShardCheckpoint,
        "load",
        classmethod(lambda cls, *args, **kwargs: folds.append(args[1]) or load(cls, *args, **kwargs)),
    )
    with caplog.at_level("WARNING", logger="generation_core.store.part_repair"):
        marker = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    assert folds == [SHARD.name]
    assert marker.num_trajectories == 12 and [r["name"] for r in marker.repaired_parts] == [before["parts"][1]["name"]]
    assert (
        f"shards/shard-00000/{before['parts'][1]['name']} is damaged (size" in caplog.text
        and "its 4 samples will be regenerated" in caplog.text
    )
    folds.clear()
    assert run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker()).last_attempt.skipped
    assert folds == [SHARD.name]


def test_a_part_damaged_after_the_shard_finished_is_named_by_the_merge_and_the_next_run_regenerates_it(tmp_path):
    from generation_core.outputs.merge import merge_run

    cfg, folder, before = _finished_run(tmp_path)
    _damage(tmp_path, before["parts"][0], "bit flip")
    with pytest.raises(
        GenrunError,
        match=rf"part .*{before['parts'][0]['name']} does not match the checksum .*run the same command again",
    ):
        merge_repairing(folder, lambda: merge_run(folder, prompt_length=4, response_length=4, pad_token_id=0))
    worker = ScriptedWorker()
    run_shard(cfg, SHARD, folder, FakePrompts(SHARD), worker)
    assert sorted(f"{i}:{n}" for i, n in worker.started) == sorted(before["completed"][:4])
    data = merge_run(folder, prompt_length=4, response_length=4, pad_token_id=0)
    assert len(data) == 12


def test_the_finished_shard_decision_folds_the_records_once_and_reads_the_rows_only_when_finished(
    tmp_path, monkeypatch
):
    """`finished_shard`, the one answer to "is this shard finished?": one fold of the shard's
    commit records serves the marker, the parts' sizes and the rows check; the digest of the rows
    is asked only for a finished shard that recorded one, and a changed digest refuses it (an
    error that pickles, as it crosses from a Ray worker)."""
    import pickle

    from generation_core.shard.finished import FinishedRowsChanged, finished_shard
    from generation_core.store import commit_log

    cfg = _cfg("generation.save_batch_size=4")
    folder = StorageFolder(str(tmp_path))
    prompts = FakePrompts(SHARD)
    prompts.rows_digest = "a" * 64
    run_shard(cfg, SHARD, folder, prompts, ScriptedWorker())

    folds, asked = [], []
    load = commit_log.ShardCheckpoint.load.__func__
    monkeypatch.setattr(
        commit_log.ShardCheckpoint,
        "load",
        classmethod(lambda cls, *args, **kwargs: folds.append(args[1]) or load(cls, *args, **kwargs)),
    )

    def digest_now():
        asked.append(SHARD.name)
        return "a" * 64

    assert finished_shard(folder, SHARD, rows_digest_now=digest_now).num_trajectories == 6
    assert folds == [SHARD.name] and asked == [SHARD.name]
    assert finished_shard(folder, SHARD, rows_digest_now=None) is not None, "the check given up (or done already)"
    with pytest.raises(
        FinishedRowsChanged, match="the dataset rows of finished shard-00000 changed since it was generated"
    ) as refused:
        finished_shard(folder, SHARD, rows_digest_now=lambda: "b" * 64)
    again = pickle.loads(pickle.dumps(refused.value))
    assert str(again) == str(refused.value) and again.shard == SHARD and isinstance(again, GenrunError)

    (tmp_path / "shards" / SHARD.name / "_SUCCESS.json").unlink()
    assert (
        finished_shard(
            folder, SHARD, rows_digest_now=lambda: pytest.fail("the rows of an unfinished shard are not read")
        )
        is None
    )
