"""Fencing holds at the commit (issue 17, item 7), on local disk and on a real S3 API (moto):
a run whose heartbeat stalled passes its lease check, stalls again right before writing, and
another run takes the folder over and starts on the shard meanwhile. Its commit (or repair) is
refused with LeaseLost and leaves the folder exactly as the new holder has it: no commit
record, no part, no failure log line, no error record. Commit records are created exclusively
under the next number (storage.StorageFolder.create_exclusive) and the new holder claims that number
first, which is what closes the window."""

import functools
import json
import threading
from dataclasses import asdict

import pytest

from generation_core.errors import GenrunError
from generation_core.inputs.shard_rows import ShardSpec
from generation_core.store.commit_log import ShardCheckpoint, read_failure_log, read_marker
from generation_core.store.folder import StorageFolder, WriteConflict
from generation_core.store.lease import LeaseLost, RunLease
from generation_core.store.run_folder import COMMITS_DIR, SUCCESS_FILE, lease_file, shard_file
from tests.conftest import S3_ENV
from tests.merge_oracles import read_committed_records
from tests.shard_runs import run_shard
from tests.test_shard import FakePrompts, ScriptedWorker, _cfg

pytestmark = pytest.mark.timeout(120)

SHARD = ShardSpec(0, 0, 6)
COMMITS = shard_file(SHARD.name, COMMITS_DIR) + "/"


@pytest.fixture(params=["local", "s3"])
def url_and_options(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run"), {}
    env = request.getfixturevalue("s3_server")
    return f"s3://genrun-test/fencing-{tmp_path.name}", {
        "endpoint_url": env["AWS_ENDPOINT_URL"],
        "key": S3_ENV["AWS_ACCESS_KEY_ID"],
        "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
    }


def _folder(url_and_options) -> StorageFolder:
    folder = StorageFolder(*url_and_options)
    folder.retry_delays = (0.05,)
    return folder


def _snapshot(folder: StorageFolder) -> dict[str, bytes]:
    """Every file of the run folder but the lease files (the takeover's own), with its bytes."""
    return {
        path[len(folder.root) + 1 :]: folder.fs.cat_file(path)
        for path in sorted(folder.fs.find(folder.root))
        if not path[len(folder.root) + 1 :].startswith("lease/")
    }


def _stall_heartbeat(folder: StorageFolder, lease: RunLease) -> None:
    """The holder's process pauses: no more heartbeats, and its last one is past expiry."""
    lease._stop.set()
    lease._heartbeat.join(timeout=30)
    lease.record.renewed -= 120
    folder.put_atomic(lease_file(lease.record.generation), json.dumps(asdict(lease.record)).encode())


def _checkpoint(folder: StorageFolder) -> ShardCheckpoint:
    return ShardCheckpoint.load(folder, SHARD.name)


class _TakeoverBeforeWrite:
    """Wraps the old run's commit records: at its `nth` part or repair record, after it passed
    its lease check, the old run stalls, and a new run takes the folder over and starts on the
    shard (creates its attempt record, the claim) before the record goes out."""

    def __init__(self, old_folder: StorageFolder, old_lease: RunLease, url_and_options, nth: int, monkeypatch):
        self.old_folder, self.old_lease, self.url_and_options, self.nth = old_folder, old_lease, url_and_options, nth
        self.puts = 0
        self.new_lease: RunLease | None = None
        self.after_takeover: dict[str, bytes] | None = None
        monkeypatch.setattr(old_folder, "create_exclusive", self._stalling(old_folder.create_exclusive))

    def _stalling(self, create):
        def stalling_create(relative, data):
            if relative.startswith(COMMITS) and json.loads(data)["kind"] != "attempt":
                self.puts += 1
                if self.puts == self.nth:
                    self.take_over()
            return create(relative, data)

        return stalling_create

    def take_over(self) -> None:
        _stall_heartbeat(self.old_folder, self.old_lease)
        new_folder = _folder(self.url_and_options)
        self.new_lease = RunLease.acquire(new_folder, seconds=60)
        ShardCheckpoint.start_attempt(new_folder, SHARD.name, self.new_lease.fence())
        self.after_takeover = _snapshot(new_folder)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nth, committed_before", [(1, 0), (2, 2)], ids=["first-commit", "a-later-commit"])
def test_a_commit_in_flight_when_another_run_takes_over_is_refused_and_changes_nothing(
    url_and_options, monkeypatch, nth, committed_before
):
    folder = _folder(url_and_options)
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1", "generation.max_failed_fraction=0.5")
    old = RunLease.acquire(folder, seconds=60)
    stall = _TakeoverBeforeWrite(folder, old, url_and_options, nth, monkeypatch)
    # The failed sample rides in the commit that stalls: its log line must not land either.
    worker = ScriptedWorker(fail_on=(100 + committed_before + 1, 0))
    try:
        with pytest.raises(LeaseLost, match="taken over by another run"):
            run_shard(cfg, SHARD, folder, FakePrompts(SHARD), worker, old.fence())
        assert stall.new_lease is not None, "the takeover happened"
        checkpoint = _checkpoint(folder)
        assert checkpoint.lease == stall.new_lease.record.generation and len(checkpoint.completed) == committed_before
        assert not checkpoint.ignored, "no record of the old lease follows the claim"
        # The part of the refused commit (written before the stall, listed by no record) was
        # removed by the new holder's attempt (issue 31, item 14: it can never be listed now);
        # the old run, refused, leaves everything as the new holder has it.
        listed = {shard_file(SHARD.name, part.name) for part in checkpoint.parts}
        assert [name for name in stall.after_takeover if name.endswith(".parquet") and name not in listed] == []
        assert _snapshot(folder) == stall.after_takeover, "the old run changed the folder after the new one started"
        assert not read_failure_log(folder, SHARD.name) and not folder.exists(shard_file(SHARD.name, "last_error.json"))
        # The new holder carries on from there and commits normally.
        manifest = run_shard(
            cfg, SHARD, _folder(url_and_options), FakePrompts(SHARD), ScriptedWorker(), stall.new_lease.fence()
        )
        assert manifest.num_trajectories == 6 and sorted(_checkpoint(folder).completed) == [
            f"{100 + p}:0" for p in range(6)
        ]
    finally:
        if stall.new_lease is not None:
            stall.new_lease.release()
        old.release()


def _finished_shard_with_a_damaged_part(folder: StorageFolder) -> None:
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    part = _checkpoint(folder).parts[1].name
    folder.put_atomic(shard_file(SHARD.name, part), b"truncated")


@pytest.mark.timeout(120)
def test_a_repair_by_a_run_that_lost_its_lease_changes_nothing(url_and_options):
    folder = _folder(url_and_options)
    _finished_shard_with_a_damaged_part(folder)
    old = RunLease.acquire(folder, seconds=60)
    _stall_heartbeat(folder, old)
    with RunLease.acquire(_folder(url_and_options), seconds=60):
        before = _snapshot(folder)
        cfg = _cfg("generation.save_batch_size=2")
        with pytest.raises(LeaseLost):
            run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker(), old.fence())
        assert _snapshot(folder) == before, "the repair dropped a part or the marker after the takeover"
    old.release()


@pytest.mark.timeout(120)
def test_a_repair_in_flight_when_another_run_takes_over_writes_no_commit_record(url_and_options, monkeypatch):
    folder = _folder(url_and_options)
    _finished_shard_with_a_damaged_part(folder)
    old = RunLease.acquire(folder, seconds=60)
    stall = _TakeoverBeforeWrite(folder, old, url_and_options, 1, monkeypatch)
    try:
        with pytest.raises(LeaseLost):
            run_shard(
                _cfg("generation.save_batch_size=2"),
                SHARD,
                folder,
                FakePrompts(SHARD),
                ScriptedWorker(),
                old.fence(),
            )
        # The last record is the new holder's claim, the damaged part still listed: its own
        # verification drops it. (The old run removed the success marker before it stalled,
        # which only makes the new holder verify the shard again.)
        assert _snapshot(folder) == stall.after_takeover
        assert _checkpoint(folder).lease == stall.new_lease.record.generation
    finally:
        if stall.new_lease is not None:
            stall.new_lease.release()
        old.release()


@pytest.mark.timeout(60)
def test_a_conditional_write_over_a_changed_file_is_refused(url_and_options):
    folder = _folder(url_and_options)
    first = folder.put_if_version("a.json", b"one", None)
    with pytest.raises(WriteConflict):
        folder.put_if_version("a.json", b"two", None)
    second = folder.put_if_version("a.json", b"two", first)
    with pytest.raises(WriteConflict):
        folder.put_if_version("a.json", b"three", first)
    with pytest.raises(WriteConflict):
        folder.put_if_version("b.json", b"one", first)
    assert folder.read_bytes("a.json") == b"two" and folder.read_versioned("a.json").version == second
    assert folder.read_versioned("b.json").data is None


@pytest.mark.timeout(60)
def test_a_conditional_write_whose_answer_was_lost_is_recognised_as_ours(s3_server, tmp_path, monkeypatch):
    folder = _folder(
        (
            f"s3://genrun-test/lost-{tmp_path.name}",
            {
                "endpoint_url": s3_server["AWS_ENDPOINT_URL"],
                "key": S3_ENV["AWS_ACCESS_KEY_ID"],
                "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            },
        )
    )
    version = folder.put_if_version("a.json", b"one", None)
    real_pipe, fired = folder.fs.pipe_file, []

    def lost_answer(path, data, **kwargs):
        # The PUT lands, the connection drops before its answer: the retry's If-Match fails.
        if "IfMatch" in kwargs and not fired:
            fired.append(path)
            real_pipe(path, data, **kwargs)
            raise ConnectionResetError("Connection reset by peer")
        return real_pipe(path, data, **kwargs)

    monkeypatch.setattr(folder.fs, "pipe_file", lost_answer)
    new_version = folder.put_if_version("a.json", b"two", version)
    current = folder.read_versioned("a.json")
    assert fired and current.data == b"two" and current.version == new_version


def _s3_folder(s3_server, tmp_path, name: str) -> StorageFolder:
    return _folder(
        (
            f"s3://genrun-test/{name}-{tmp_path.name}",
            {
                "endpoint_url": s3_server["AWS_ENDPOINT_URL"],
                "key": S3_ENV["AWS_ACCESS_KEY_ID"],
                "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            },
        )
    )


# The three conditional writes: (folder, name, data, version read before) -> its answer.
CONDITIONAL_WRITES = {
    "create_exclusive": lambda folder, name, data, version: folder.create_exclusive(name, data),
    "put_if_version-absent": lambda folder, name, data, version: folder.put_if_version(name, data, None),
    "put_if_version-version": lambda folder, name, data, version: folder.put_if_version(name, data, version),
}


def _refused(write: str, folder: StorageFolder, name: str, data: bytes, version: str | None) -> None:
    if write == "create_exclusive":
        assert CONDITIONAL_WRITES[write](folder, name, data, version) is False
    else:
        with pytest.raises(WriteConflict):
            CONDITIONAL_WRITES[write](folder, name, data, version)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("write", list(CONDITIONAL_WRITES))
def test_a_conditional_write_that_s3fs_retried_on_its_own_is_recognised_as_ours(
    s3_server, tmp_path, monkeypatch, write
):
    """The PUT lands and its answer is lost inside s3fs: s3fs's own retry loop (not StorageFolder's)
    sends it again, the condition refuses the retry, and StorageFolder sees a refusal of its first
    attempt. The stored bytes are ours (a token in them says so): the write succeeded."""
    import botocore.exceptions

    folder = _s3_folder(s3_server, tmp_path, "s3fs-retry")
    version = folder.put_if_version("a.json", b"before", None) if write == "put_if_version-version" else None
    client = folder.fs.s3
    real_put, fired = client.put_object, []

    @functools.wraps(real_put)
    async def put_object(**kwargs):
        answer = await real_put(**kwargs)
        if not fired:
            fired.append(kwargs["Key"])
            raise botocore.exceptions.ReadTimeoutError(
                endpoint_url=s3_server["AWS_ENDPOINT_URL"]
            )  # s3fs retries this itself
        return answer

    monkeypatch.setattr(client, "put_object", put_object)
    ours = b'{"token": "ours-1f3a"}'
    answer = CONDITIONAL_WRITES[write](folder, "a.json", ours, version)
    current = folder.read_versioned("a.json")
    assert fired and current.data == ours
    assert answer is True if write == "create_exclusive" else answer == current.version


@pytest.mark.timeout(60)
@pytest.mark.parametrize("write", ["create_exclusive", "put_if_version-absent"])
def test_a_create_that_finds_exactly_its_own_bytes_succeeds_and_other_bytes_are_refused(s3_server, tmp_path, write):
    """A create whose first attempt landed but whose answer was lost, on any layer: the object
    holds our bytes (with our token) and the create is ours; anyone else's bytes refuse it."""
    folder = _s3_folder(s3_server, tmp_path, "own-bytes")
    ours, theirs = b'{"token": "ours-1f3a"}', b'{"token": "theirs-9c0d"}'
    folder.put_atomic("ours.json", ours)
    folder.put_atomic("theirs.json", theirs)
    answer = CONDITIONAL_WRITES[write](folder, "ours.json", ours, None)
    assert answer is True if write == "create_exclusive" else answer == folder.read_versioned("ours.json").version
    _refused(write, folder, "theirs.json", ours, None)
    assert folder.read_bytes("ours.json") == ours and folder.read_bytes("theirs.json") == theirs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("write", list(CONDITIONAL_WRITES))
def test_a_conditional_write_of_a_large_body_keeps_its_condition(s3_server, tmp_path, monkeypatch, write):
    """s3fs sends a body of 2 x chunksize (100 MiB) or more as a multipart upload, which drops
    If-Match (and a put's If-None-Match). The test lowers s3fs's default chunksize to 5 MiB (S3's
    smallest part) so that an 11 MiB body would go multipart, instead of sending 100 MiB."""
    import s3fs

    defaults = s3fs.S3FileSystem._pipe_file.__defaults__
    assert defaults[0] == 50 * 2**20, (
        f"s3fs's _pipe_file defaults changed ({defaults}): revisit storage.SINGLE_PUT_LIMIT and this test"
    )
    monkeypatch.setattr(s3fs.S3FileSystem._pipe_file, "__defaults__", (5 * 2**20, *defaults[1:]))
    folder = _s3_folder(s3_server, tmp_path, "large")
    stored = b"s" * (11 * 2**20)
    stale = folder.put_if_version("a.json", b"before", None)
    version = folder.put_if_version("a.json", stored, stale)
    assert folder.read_versioned("a.json").version == version
    _refused(write, folder, "a.json", b"x" * (11 * 2**20), stale)
    assert folder.read_bytes("a.json") == stored, "a large conditional write replaced the file unconditionally"


@pytest.mark.timeout(120)
def test_a_commit_record_whose_answer_s3fs_lost_keeps_its_part_and_the_shard_finishes(s3_server, tmp_path, monkeypatch):
    """The record of the first part lands, its answer is lost and s3fs retries it on its own: the
    retry is refused, and that refusal is our own record, not another writer's. Before, the shard
    took it for a conflict, deleted the part the record lists and failed."""
    import botocore.exceptions

    folder = _s3_folder(s3_server, tmp_path, "commit-lost")
    client = folder.fs.s3
    real_put, fired = client.put_object, []

    @functools.wraps(real_put)
    async def put_object(**kwargs):
        answer = await real_put(**kwargs)
        if kwargs["Key"].endswith(f"/{COMMITS_DIR}/0000000001.json") and not fired:
            fired.append(kwargs["Key"])
            raise botocore.exceptions.ReadTimeoutError(endpoint_url=s3_server["AWS_ENDPOINT_URL"])
        return answer

    monkeypatch.setattr(client, "put_object", put_object)
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=2")
    manifest = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    assert fired and manifest.num_trajectories == 6 and manifest.failures == 0
    assert [r.key for r in read_committed_records(folder)] == [(100 + p, 0) for p in range(6)], (
        "every listed part is there"
    )


@pytest.mark.timeout(60)
def test_a_conditional_write_larger_than_one_put_is_refused_loudly(s3_server, tmp_path, monkeypatch):
    import generation_core.store.folder as storage

    monkeypatch.setattr(storage, "SINGLE_PUT_LIMIT", 1024)
    folder = _s3_folder(s3_server, tmp_path, "too-large")
    for write in CONDITIONAL_WRITES:
        with pytest.raises(GenrunError, match="more than one S3 PUT takes"):
            CONDITIONAL_WRITES[write](folder, "a.json", b"x" * 1024, None)
    assert not folder.exists("a.json")


@pytest.mark.timeout(60)
def test_of_local_writers_racing_from_one_version_exactly_one_wins(tmp_path):
    folder = StorageFolder(str(tmp_path / "run"))
    version = folder.put_if_version("checkpoint.json", b"start", None)
    start, results = threading.Barrier(8), []

    def writer(n):
        start.wait()
        try:
            folder.put_if_version("checkpoint.json", f"writer {n}".encode(), version)
            results.append(n)
        except WriteConflict:
            pass

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 1 and folder.read_bytes("checkpoint.json") == f"writer {results[0]}".encode()


@pytest.mark.timeout(120)
def test_a_merge_repair_and_a_marker_by_a_run_that_lost_its_lease_change_nothing(url_and_options):
    """The merge's repair of a part it found damaged, and the success marker, are fenced too."""
    from generation_core.outputs.finish import merge_repairing
    from generation_core.store.commit_log import read_marker, write_marker
    from generation_core.store.part_repair import DamagedPart

    folder = _folder(url_and_options)
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    manifest = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    part = shard_file(SHARD.name, manifest.parts[0].name)
    old = RunLease.acquire(folder, seconds=60)
    _stall_heartbeat(folder, old)
    with RunLease.acquire(_folder(url_and_options), seconds=60):
        before = _snapshot(folder)

        def merge_finding_damage():
            raise DamagedPart(f"part {part} does not match the checksum its checkpoint recorded", part)

        with pytest.raises(LeaseLost):
            merge_repairing(folder, merge_finding_damage, old.fence())
        with pytest.raises(LeaseLost):
            write_marker(folder, read_marker(folder, SHARD.name), old.fence())
        assert _snapshot(folder) == before, "a run that lost the folder changed it"
    old.release()


# --- the done record and the finishing steps (issue 31, item 11) -----------------------------------


@pytest.mark.timeout(120)
def test_a_marker_in_flight_when_another_run_takes_over_writes_no_done_record(url_and_options, monkeypatch):
    """The shard's success marker is backed by a `done` commit record created exclusively under
    the next number: a run that passed its lease check and stalled right before finishing the
    shard finds the number claimed by the new holder, writes no done record and no marker."""
    folder = _folder(url_and_options)
    cfg = _cfg("generation.max_inflight=1")  # one part: its record is the first write, the done record the second
    old = RunLease.acquire(folder, seconds=60)
    stall = _TakeoverBeforeWrite(folder, old, url_and_options, 2, monkeypatch)
    try:
        with pytest.raises(LeaseLost, match="taken over by another run"):
            run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker(), old.fence())
        assert stall.new_lease is not None, "the takeover happened at the done record"
        assert _snapshot(folder) == stall.after_takeover, "no done record, no marker after the takeover"
        assert read_marker(folder, SHARD.name) is None
        # The new holder finishes the shard (nothing left to generate) under its own done record.
        worker = ScriptedWorker()
        manifest = run_shard(cfg, SHARD, _folder(url_and_options), FakePrompts(SHARD), worker, stall.new_lease.fence())
        assert worker.started == [] and manifest.num_trajectories == 6
        assert read_marker(folder, SHARD.name).done_record == _checkpoint(folder).done_seq is not None
    finally:
        if stall.new_lease is not None:
            stall.new_lease.release()
        old.release()


@pytest.mark.timeout(120)
def test_a_stale_marker_is_not_read_as_finished(tmp_path):
    """A marker a run that lost the folder wrote after its checks (its done record landed before
    the new holder's claim) names a done record that is not the shard's last: ignored, and the
    shard is finished again once."""
    folder = StorageFolder(str(tmp_path / "run"))
    cfg = _cfg("generation.save_batch_size=2")
    run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    late_marker = folder.read_bytes(shard_file(SHARD.name, SUCCESS_FILE))
    ShardCheckpoint.start_attempt(folder, SHARD.name)  # a new holder claims the shard ...
    folder.put_atomic(shard_file(SHARD.name, SUCCESS_FILE), late_marker)  # ... and the old marker lands after
    assert read_marker(folder, SHARD.name) is None
    again = ScriptedWorker()
    manifest = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), again)
    assert again.started == [] and manifest.num_trajectories == 6 and read_marker(folder, SHARD.name) is not None


def _take_over(url_and_options, lease: RunLease, taken: list[RunLease]) -> None:
    _stall_heartbeat(StorageFolder(*url_and_options), lease)
    taken.append(RunLease.acquire(_folder(url_and_options), seconds=60))


@pytest.mark.timeout(180)
def test_a_merge_or_publish_in_flight_when_another_run_takes_over_publishes_nothing(tmp_path, monkeypatch):
    """The run's finishing steps check the lease immediately before each file appears: a run
    taken over while it writes trajectories.pkl (or the zip) publishes neither it nor
    manifest.json, and logs nothing to its trackers."""
    from types import SimpleNamespace

    from generation_core.config.settings import GenerationSettings
    from generation_core.driver import publish
    from generation_core.outputs import merge
    from generation_core.outputs.finish import finish_run
    from generation_core.store.run_folder import MANIFEST_FILE, MERGED_FILE, RUN_FILE, ZIP_FILE

    url_and_options = (str(tmp_path / "run"), {})
    folder = _folder(url_and_options)
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1")
    manifest = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    folder.put_json(RUN_FILE, {"fingerprint": "f" * 64})
    plan = SimpleNamespace(
        folder=folder, cfg=cfg, settings=GenerationSettings.of(cfg), pad_token_id=2, fingerprint="f" * 64
    )
    taken: list[RunLease] = []
    old = RunLease.acquire(folder, seconds=60)
    real_dump = merge.dump_dataproto

    def dump_while_taken_over(data, handle):
        _take_over(url_and_options, old, taken)
        return real_dump(data, handle)

    monkeypatch.setattr(merge, "dump_dataproto", dump_while_taken_over)
    before = _snapshot(folder)
    try:
        with pytest.raises(LeaseLost):
            finish_run(plan, [manifest], 1.0, old.fence())
        assert taken and _snapshot(folder) == before, "no trajectories.pkl, no manifest.json"

        # The holder merges; then, while it writes the zip, another run takes over.
        monkeypatch.setattr(merge, "dump_dataproto", real_dump)
        holder = taken.pop()
        summary = finish_run(plan, [manifest], 1.0, holder.fence())
        assert folder.exists(MERGED_FILE) and folder.exists(MANIFEST_FILE)
        real_open_read, tracked = StorageFolder.open_read, []

        def read_while_taken_over(self, relative):
            if not taken:
                _take_over(url_and_options, holder, taken)
            return real_open_read(self, relative)

        monkeypatch.setattr(StorageFolder, "open_read", read_while_taken_over)
        monkeypatch.setattr(publish, "Tracking", lambda **kwargs: tracked.append(kwargs))
        before = _snapshot(folder)
        with pytest.raises(LeaseLost):
            publish.publish_run(cfg, folder, summary, fence=holder.fence(), settings=GenerationSettings.of(cfg))
        assert taken and not folder.exists(ZIP_FILE) and _snapshot(folder) == before and not tracked
    finally:
        for lease in taken:
            lease.release()
        old.release()
