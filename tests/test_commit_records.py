"""Shard progress as numbered commit records, and parts cut by size and age (issue 16, items 4
and 5): a record's size does not grow with the shard, the records weigh little next to the
parts, a crash between a part and its record regenerates exactly the missing samples without
reading the orphan, a takeover keeps the fencing guarantee on local disk and S3, parts are cut
by size, by age and not at all below the 64 MiB default, a part of many row groups merges
byte-identically, and a folder of the earlier format is refused with what to do."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from generation_core.errors import GenrunError
from generation_core.inputs.shard_rows import ShardSpec
from generation_core.outputs.merge import merge_run
from generation_core.shard import part_writer
from generation_core.store.commit_log import CheckpointConflict, ShardCheckpoint, read_commit_records, sample_keys
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseFence, LeaseLost, RunLease
from generation_core.store.run_folder import (
    COMMITS_DIR,
    RUN_FILE,
    PartEntry,
    check_run_folder,
    commit_file,
    shard_file,
)
from generation_core.store.trajectory_record import TrajectoryRecord, records_to_parquet
from tests.conftest import REPO
from tests.merge_oracles import read_committed_records
from tests.run_folder_helpers import checkpoint_dict, committed_keys
from tests.shard_runs import run_shard
from tests.test_fencing import _folder, _snapshot, _stall_heartbeat, url_and_options  # noqa: F401 - a fixture
from tests.test_shard import FakePrompts, ScriptedWorker, _cfg

SHARD = ShardSpec(0, 0, 6)


class TokenWorker(ScriptedWorker):
    """Trajectories the size of real ones: random prompt and response tokens, with logprobs."""

    def __init__(self, prompt_tokens: int = 128, response_tokens: int = 512, **kwargs):
        super().__init__(**kwargs)
        self.prompt_tokens, self.response_tokens = prompt_tokens, response_tokens

    async def run_one(self, key, kwargs):
        self.started.append(key)
        await asyncio.sleep(0)
        rng = random.Random(hash(key))
        response = [rng.randrange(49152) for _ in range(self.response_tokens)]
        return TrajectoryRecord(
            key[0],
            key[1],
            [rng.randrange(49152) for _ in range(self.prompt_tokens)],
            response,
            [1] * len(response),
            [-rng.random() for _ in response],
            float(key[0] % 2),
            2,
            kwargs,
            {},
            {},
        )


def _commit_sizes(run_dir, shard: str = SHARD.name) -> list[int]:
    directory = run_dir / "shards" / shard / COMMITS_DIR
    return [path.stat().st_size for path in sorted(directory.iterdir())]


def _part(folder: StorageFolder, name: str, indices: list[int]) -> PartEntry:
    data = records_to_parquet(
        [TrajectoryRecord(i, 0, [1, 2], [3, 2], [1, 1], None, None, 2, {}, {}, {}) for i in indices]
    )
    folder.put_atomic(shard_file(SHARD.name, name), data)
    return PartEntry(
        name=name,
        count=len(indices),
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        response_tokens=2 * len(indices),
        generated_tokens=2 * len(indices),
    )


# --- record sizes ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_commit_record_does_not_grow_with_the_shard(tmp_path):
    folder = StorageFolder(str(tmp_path))
    checkpoint = ShardCheckpoint.start_attempt(folder, SHARD.name)
    for number in range(200):
        indices = [100_000 + 8 * number + k for k in range(8)]
        checkpoint.commit_part(
            folder,
            SHARD.name,
            _part(folder, f"batch-{number:05d}-test0000.parquet", indices),
            [f"{i}:0" for i in indices],
        )
    sizes = _commit_sizes(tmp_path)[1:]  # the part records (the first is the attempt's)
    print(f"part commit record sizes: first {sizes[0]} bytes, last {sizes[-1]} bytes, largest {max(sizes)} bytes")
    assert len(sizes) == 200 and max(sizes) <= sizes[0] + 16, "a record holds its own part only"
    loaded = ShardCheckpoint.load(folder, SHARD.name)
    assert len(loaded.parts) == 200 and len(loaded.completed) == 1600 and loaded.completed == checkpoint.completed
    assert loaded.response_tokens == 3200 and loaded.next_seq == 201


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cap", [None, 16], ids=["defaults", "parts-of-16"])
def test_commit_bytes_written_over_a_shard_next_to_its_part_bytes(tmp_path, cap):
    """Every byte of checkpoint the shard ever wrote (its records are never rewritten) against
    the bytes of its parts."""
    shard = ShardSpec(0, 0, 2000)
    # The size target alone cuts parts here (a slow machine must not cut the first one by age).
    cfg = _cfg(
        "generation.max_inflight=64",
        "generation.first_part_max_seconds=null",
        *([f"generation.save_batch_size={cap}"] if cap else []),
    )
    manifest = run_shard(cfg, shard, StorageFolder(str(tmp_path)), FakePrompts(shard), TokenWorker())
    commit_bytes = sum(_commit_sizes(tmp_path))
    part_bytes = sum(p.bytes for p in manifest.parts)
    ratio = commit_bytes / part_bytes
    print(
        f"save_batch_size={cap}: {len(manifest.parts)} part(s), {part_bytes} part bytes, {commit_bytes} commit bytes, ratio {ratio:.4%}"
    )
    assert manifest.num_trajectories == 2000
    if cap is None:
        assert len(manifest.parts) == 1, "2000 trajectories (~6 MB) are far below the 64 MiB target: one part"
        assert ratio < 0.001
    else:
        assert len(manifest.parts) == 125 and ratio < 0.02


# --- crash between a part and its record ---------------------------------------------------------


CRASHING_SHARD = """
from generation_core.inputs.shard_rows import ShardSpec
from generation_core.store.folder import StorageFolder
from tests.shard_runs import run_shard
from tests.test_shard import FakePrompts, ScriptedWorker, _cfg

shard = ShardSpec(0, 0, 9)
cfg = _cfg("generation.save_batch_size=3", "generation.max_inflight=1")
run_shard(cfg, shard, StorageFolder({run_dir!r}), FakePrompts(shard), ScriptedWorker())
"""


@pytest.mark.timeout(300)
def test_a_crash_between_a_part_and_its_record_regenerates_exactly_the_missing_samples(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    env = dict(os.environ, GENRUN_FAILPOINTS="after_part_write@2:kill", PYTHONPATH=str(REPO))
    crashed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASHING_SHARD.format(run_dir=str(run_dir)))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    shard_dir = run_dir / "shards" / SHARD.name
    committed = committed_keys(run_dir, SHARD.name)
    assert committed == ["100:0", "101:0", "102:0"], "the first part is committed, the second was not"
    listed = {p["name"] for p in checkpoint_dict(run_dir)["parts"]}
    (orphan,) = [p.name for p in shard_dir.glob("batch-*.parquet") if p.name not in listed]

    read = []
    real_read = StorageFolder.read_bytes

    def reading(self, relative):
        read.append(relative)
        return real_read(self, relative)

    monkeypatch.setattr(StorageFolder, "read_bytes", reading)
    shard = ShardSpec(0, 0, 9)
    worker = ScriptedWorker()
    folder = StorageFolder(str(run_dir))
    manifest = run_shard(
        _cfg("generation.save_batch_size=3", "generation.max_inflight=1"), shard, folder, FakePrompts(shard), worker
    )
    assert sorted(worker.started) == [(100 + p, 0) for p in range(3, 9)], "exactly the samples no record holds"
    assert manifest.num_trajectories == 9 and manifest.attempts == 2
    assert [r.key for r in read_committed_records(folder)] == [(100 + p, 0) for p in range(9)]
    assert not [path for path in read if path.endswith(orphan)], "the orphan part is never read"
    assert (shard_dir / orphan).exists() and orphan not in {p.name for p in manifest.parts}


# --- fencing --------------------------------------------------------------------------------------


class _CheckedBeforeTheTakeover:
    """The old holder's fence as a stalled run sees it: its lease check passed just before the
    takeover; every later check is the real one."""

    def __init__(self, generation: int):
        self.generation, self.passed = generation, False

    def check(self, folder: StorageFolder) -> None:
        if not self.passed:
            self.passed = True
            return
        LeaseFence(self.generation).check(folder)


@pytest.mark.timeout(120)
def test_a_takeover_reads_what_landed_before_its_claim_and_refuses_what_comes_after(url_and_options):  # noqa: F811 - the fixture
    folder = _folder(url_and_options)
    old = RunLease.acquire(folder, seconds=60)
    new = None
    try:
        old_view = ShardCheckpoint.start_attempt(folder, SHARD.name, old.fence())
        old_view.commit_part(
            folder, SHARD.name, _part(folder, "batch-00000-aaaaaaaa.parquet", [100]), ["100:0"], fence=old.fence()
        )
        _stall_heartbeat(folder, old)
        new = RunLease.acquire(_folder(url_and_options), seconds=60)
        new_folder = _folder(url_and_options)
        new_view = ShardCheckpoint.start_attempt(new_folder, SHARD.name, new.fence())
        assert new_view.completed == ["100:0"] and new_view.attempts == 2, (
            "the commit that landed before the claim is read"
        )
        assert new_view.lease == new.record.generation

        # The old holder passed its lease check, stalled, and commits now: its number is the claim's.
        late = _part(folder, "batch-00001-bbbbbbbb.parquet", [101])
        before = _snapshot(folder)
        with pytest.raises(LeaseLost):
            old_view.commit_part(
                folder, SHARD.name, late, ["101:0"], fence=_CheckedBeforeTheTakeover(old.record.generation)
            )
        assert _snapshot(folder) == before, "the refused commit created no record"
        with pytest.raises(LeaseLost):
            ShardCheckpoint.load(folder, SHARD.name, old.fence())

        # A record of the old lease after the claim (genrun never writes one) is ignored by the fold.
        forged = {
            "kind": "part",
            "seq": new_view.next_seq,
            "lease": old.record.generation,
            "token": "forged",
            "time": 0,
            "part": json.loads(json.dumps(late.__dict__)),
            "samples": ["101:0"],
            "failed": [],
        }
        assert folder.create_exclusive(commit_file(SHARD.name, new_view.next_seq), json.dumps(forged).encode())
        folded = ShardCheckpoint.load(new_folder, SHARD.name)
        assert (
            folded.completed == ["100:0"]
            and folded.ignored == [new_view.next_seq]
            and folded.lease == new.record.generation
        )
        # The new holder's next record goes after it (its view is stale: refused, then read again).
        with pytest.raises(CheckpointConflict):
            new_view.commit_part(
                new_folder,
                SHARD.name,
                _part(new_folder, "batch-00001-cccccccc.parquet", [102]),
                ["102:0"],
                fence=new.fence(),
            )
        fresh = ShardCheckpoint.load(new_folder, SHARD.name, new.fence())
        fresh.commit_part(
            new_folder,
            SHARD.name,
            _part(new_folder, "batch-00001-dddddddd.parquet", [102]),
            ["102:0"],
            fence=new.fence(),
        )
        assert ShardCheckpoint.load(folder, SHARD.name).completed == ["100:0", "102:0"]
    finally:
        if new is not None:
            new.release()
        old.release()


# --- parts cut by size and age --------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_parts_are_cut_by_size(tmp_path):
    shard = ShardSpec(0, 0, 200)
    target = 16 * 1024
    cfg = _cfg(f"generation.part_target_bytes={target}", "generation.max_inflight=8")
    manifest = run_shard(
        cfg,
        shard,
        StorageFolder(str(tmp_path)),
        FakePrompts(shard),
        TokenWorker(prompt_tokens=32, response_tokens=128),
    )
    sizes = [p.bytes for p in manifest.parts]
    print(f"{len(sizes)} parts of {sizes} bytes (target {target})")
    assert len(sizes) > 3 and all(size >= target for size in sizes[:-1]) and all(size < 4 * target for size in sizes)
    assert sum(p.count for p in manifest.parts) == 200
    assert sorted(r.key for r in read_committed_records(StorageFolder(str(tmp_path)))) == [
        (100 + p, 0) for p in range(200)
    ]


@pytest.mark.timeout(120)
def test_parts_are_cut_by_age(tmp_path):
    shard = ShardSpec(0, 0, 6)
    cfg = _cfg("generation.part_max_seconds=0.000001", "generation.max_inflight=1")
    manifest = run_shard(cfg, shard, StorageFolder(str(tmp_path)), FakePrompts(shard), ScriptedWorker())
    assert [p.count for p in manifest.parts] == [1] * 6, (
        "each trajectory was older than part_max_seconds once it was added"
    )


@pytest.mark.timeout(120)
def test_the_default_target_keeps_a_small_shard_in_one_part(tmp_path):
    shard = ShardSpec(0, 0, 300)
    manifest = run_shard(
        _cfg("generation.max_inflight=16", "generation.first_part_max_seconds=null"),
        shard,
        StorageFolder(str(tmp_path)),
        FakePrompts(shard),
        TokenWorker(),
    )
    assert len(manifest.parts) == 1 and manifest.parts[0].count == 300
    assert len(_commit_sizes(tmp_path)) == 3, "one attempt record, one part record, the done record"


@pytest.mark.timeout(120)
def test_a_part_of_many_row_groups_merges_byte_identically(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    shard = ShardSpec(0, 0, 40)
    records = [
        asyncio.run(
            TokenWorker(prompt_tokens=16, response_tokens=24).run_one((100 + p, 0), FakePrompts(shard).agent_kwargs(p))
        )
        for p in range(40)
    ]
    # Today's layout: the part as one table.
    whole = StorageFolder(str(tmp_path / "whole"))
    data = records_to_parquet(records)
    whole.put_atomic(shard_file(SHARD.name, "batch-00000-whole000.parquet"), data)
    ShardCheckpoint().commit_part(
        whole,
        SHARD.name,
        PartEntry("batch-00000-whole000.parquet", 40, len(data), hashlib.sha256(data).hexdigest()),
        [f"{r.index}:0" for r in records],
    )
    # Streamed: row groups of 6 records.
    monkeypatch.setattr(part_writer, "ROW_GROUP_RECORDS", 6)
    streamed = StorageFolder(str(tmp_path / "streamed"))
    writer = part_writer.PartWriter(streamed, SHARD.name, 0, ShardCheckpoint.start_attempt(streamed, SHARD.name))
    for record in records:
        writer.add(record)
        if writer.row_group_ready():
            writer.write_row_group()
    writer.commit()
    (part,) = writer.checkpoint.parts
    path = tmp_path / "streamed" / "shards" / SHARD.name / part.name
    assert pq.ParquetFile(path).num_row_groups == 7 and part.bytes == path.stat().st_size
    assert part.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    for folder in (whole, streamed):
        merge_run(folder, prompt_length=16, response_length=24, pad_token_id=2)
    assert (tmp_path / "whole" / "trajectories.pkl").read_bytes() == (
        tmp_path / "streamed" / "trajectories.pkl"
    ).read_bytes()


# --- a folder of the earlier format ---------------------------------------------------------------


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(60)
def test_a_folder_of_another_format_is_refused_in_one_line_and_a_resume_lists_no_shard(tmp_path, monkeypatch):
    """Issue 53 item 5: one format check (run.json's folder format) refuses every other format in
    one line, changing nothing; a resume of this format reads run.json and lists no shard folder
    (it used to list every shard looking for an earlier format's checkpoint.json)."""
    run_dir = tmp_path / "old-run"
    folder = StorageFolder(str(run_dir))
    folder.put_json(RUN_FILE, {"fingerprint": "a" * 64, "fingerprint_version": 2, "versions": {"genrun": "0.4.0"}})
    folder.put_json(shard_file(SHARD.name, "checkpoint.json"), {"parts": [], "completed": ["100:0"]})
    before = _files(run_dir)
    with pytest.raises(GenrunError) as refused:
        check_run_folder(folder, "a" * 64)
    message = str(refused.value)
    print(message)
    assert message == (
        f"output folder {run_dir} is in folder format 2 (written by genrun 0.4.0); this genrun reads format 3 only. "
        "Nothing was changed there. Finish it with that genrun version (pip install genrun==0.4.0). To start fresh, "
        "set another trainer.default_local_dir (or trainer.experiment_name, when that folder is derived from it) or "
        "delete that folder"
    )
    assert _files(run_dir) == before, "nothing written"

    resumed = StorageFolder(str(tmp_path / "resumed"))
    resumed.put_json(RUN_FILE, {"fingerprint": "a" * 64, "fingerprint_version": 3})
    for shard in range(3):
        ShardCheckpoint.start_attempt(resumed, f"shard-{shard:05d}")
    listed = []
    real_list = resumed.list
    monkeypatch.setattr(resumed, "list", lambda relative="": listed.append(relative) or real_list(relative))
    assert check_run_folder(resumed, "a" * 64).fingerprint == "a" * 64
    assert listed == [], "a resume lists no shard"


@pytest.mark.timeout(60)
def test_the_first_rows_digest_is_kept_and_a_changed_one_refused(tmp_path):
    folder = StorageFolder(str(tmp_path))
    assert ShardCheckpoint.start_attempt(folder, SHARD.name).rows_digest is None
    assert ShardCheckpoint.start_attempt(folder, SHARD.name, rows_digest="a" * 64).rows_digest == "a" * 64
    again = ShardCheckpoint.start_attempt(folder, SHARD.name, rows_digest="a" * 64)
    assert again.rows_digest == "a" * 64 and again.attempts == 3
    with pytest.raises(GenrunError, match=f"the dataset rows of {SHARD.name} changed since its first attempt"):
        ShardCheckpoint.start_attempt(folder, SHARD.name, rows_digest="b" * 64)
    assert len(_commit_sizes(tmp_path)) == 3, "the refused attempt wrote nothing"


@pytest.mark.timeout(60)
def test_a_folder_with_shards_and_no_run_json_is_refused(tmp_path):
    """Shard progress that no run.json names belongs to nobody this run can check (issue 31,
    item 15): refused, nothing written."""
    run_dir = tmp_path / "orphaned"
    folder = StorageFolder(str(run_dir))
    ShardCheckpoint.start_attempt(folder, SHARD.name)
    before = _files(run_dir)
    with pytest.raises(
        GenrunError,
        match=rf"output folder {run_dir} holds {run_dir}/shards but no run.json.*Set another trainer.default_local_dir",
    ) as refused:
        check_run_folder(folder, "a" * 64)
    assert "\n" not in str(refused.value)
    assert _files(run_dir) == before, "nothing written"


# --- a commit racing the attempt's discard (issue 31, item 10) -------------------------------------


@pytest.mark.timeout(60)
def test_a_commit_in_flight_when_its_shard_is_cancelled_records_its_samples(tmp_path, monkeypatch):
    """The flow's stop fallback cancels a shard job while a commit runs in its thread: the
    commit completes with its samples before the attempt's discard runs (which would empty the
    sample list the record is being written from), and the resume is exact."""
    import threading

    folder = StorageFolder(str(tmp_path))
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    in_commit, discarded = threading.Event(), threading.Event()
    real_discard = part_writer.PartWriter.discard

    def discard(self):
        real_discard(self)
        discarded.set()

    def failpoint(name):
        # The commit thread, between its part and its record: the task awaiting it is cancelled.
        if name == "after_part_write" and not in_commit.is_set():
            in_commit.set()
            running["loop"].call_soon_threadsafe(running["task"].cancel)
            discarded.wait(2)  # today's discard runs now; a shielded commit waits it out

    monkeypatch.setattr(part_writer.PartWriter, "discard", discard)
    monkeypatch.setattr(part_writer, "failpoint", failpoint)

    running = {}

    def entered(worker):
        # In the attempt's event loop: the task the flow's stop fallback would cancel.
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()

    with pytest.raises(asyncio.CancelledError):
        run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker(), entered=entered)
    assert in_commit.is_set() and discarded.is_set()
    _, records = read_commit_records(folder, SHARD.name)
    parts = [record for record in records if record["kind"] == "part" and record["part"]]
    assert [(r["part"]["count"], len(sample_keys(r["samples"]))) for r in parts] == [(2, 2)], (
        "the record lists its part's samples"
    )
    manifest = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    assert manifest.num_trajectories == 6
    assert [r.key for r in read_committed_records(folder)] == [(100 + p, 0) for p in range(6)], "each sample once"


# --- the failure log (issue 31, item 12) -----------------------------------------------------------


def _failure_log_bytes_written(folder: StorageFolder, commits: int, monkeypatch) -> int:
    """Bytes written into shard-00000's failure log over `commits` commits of one failure each."""
    from generation_core.store.trajectory_record import SampleFailure

    written = []
    for name in ("put_atomic", "put_if_version", "create_exclusive"):
        real = getattr(folder, name)

        def counting(relative, data, *args, _real=real):
            if "/failures" in relative:
                written.append(len(data))
            return _real(relative, data, *args)

        monkeypatch.setattr(folder, name, counting)
    writer = part_writer.PartWriter(folder, SHARD.name, 0, ShardCheckpoint.start_attempt(folder, SHARD.name))
    for index in range(commits):
        writer.add_failure(SampleFailure(index, 0, "RuntimeError: boom", "Traceback ...\n" * 10))
        writer.commit()
    return sum(written)


@pytest.mark.timeout(60)
def test_the_failure_log_grows_linearly_and_every_failure_is_read_once(tmp_path, monkeypatch):
    """Each commit with failures writes its own lines once (S3 cannot append: a log rewritten
    whole at every commit writes O(k^2) bytes); errors and tracebacks are capped; status and the
    report see every failure once."""
    small = _failure_log_bytes_written(StorageFolder(str(tmp_path / "k")), 20, monkeypatch)
    large = _failure_log_bytes_written(StorageFolder(str(tmp_path / "4k")), 80, monkeypatch)
    print(f"failure log bytes written: {small} for 20 commits, {large} for 80")
    assert large <= 4.2 * small, "linear in the commits, not quadratic"

    from generation_core.report.data import _failures
    from generation_core.store.commit_log import read_failure_log
    from generation_core.store.trajectory_record import SampleFailure

    folder = StorageFolder(str(tmp_path / "4k"))
    writer = part_writer.PartWriter(folder, SHARD.name, 0, ShardCheckpoint.load(folder, SHARD.name))
    writer.add_failure(SampleFailure(500, 0, "E" * 50_000, "T" * 50_000 + "the raising frame"))
    writer.commit()
    logged = read_failure_log(folder, SHARD.name)
    assert [entry["index"] for entry in logged] == [*range(80), 500], "every failure once, oldest first"
    huge = logged[-1]
    assert (
        len(huge["error"]) < 2100 and len(huge["traceback"]) < 2100 and huge["traceback"].endswith("the raising frame")
    )
    assert [(entry.index, entry.error) for entry in _failures(folder, SHARD.name, set())][:2] == [
        (0, "RuntimeError: boom"),
        (1, "RuntimeError: boom"),
    ]
    assert len(_failures(folder, SHARD.name, set())) == 81


# --- what a killed writer leaves (issue 31, item 14) -----------------------------------------------


@pytest.mark.timeout(60)
def test_the_next_attempt_under_the_lease_removes_orphan_parts_and_temporary_files(tmp_path):
    """kill -9 between a part and its record leaves an orphan part, and one during a write a
    `.tmp-*` file: the next attempt that holds the lease removes both once its attempt record
    exists, and keeps every listed part and whatever is newer than its start."""
    run_dir = tmp_path / "run"
    folder = StorageFolder(str(run_dir))
    checkpoint = ShardCheckpoint.start_attempt(folder, SHARD.name)
    listed = _part(folder, "batch-00000-aaaaaaaa.parquet", [100, 101])
    checkpoint.commit_part(folder, SHARD.name, listed, ["100:0", "101:0"])
    shard_dir = run_dir / "shards" / SHARD.name
    left = [
        shard_dir / "batch-00001-bbbbbbbb.parquet",
        shard_dir / ".tmp-0123abcd-batch-00001-cccccccc.parquet",
        shard_dir / COMMITS_DIR / ".tmp-4567ef01-0000000002.json",
    ]
    for path in left:
        path.write_bytes(b"left by a killed writer")
        os.utime(path, (os.path.getmtime(path) - 600,) * 2)
    newer = shard_dir / "batch-00002-dddddddd.parquet"
    newer.write_bytes(b"written after the attempt started")
    os.utime(newer, (os.path.getmtime(newer) + 600,) * 2)
    with RunLease.acquire(folder, seconds=60) as lease:
        resumed = ShardCheckpoint.start_attempt(folder, SHARD.name, lease.fence())
    assert [path.name for path in left if path.exists()] == [], "orphan part and temporary files removed"
    assert (shard_dir / listed.name).exists() and newer.exists(), "listed parts and newer files stay"
    assert [p.name for p in resumed.parts] == [listed.name] and resumed.completed == ["100:0", "101:0"]
