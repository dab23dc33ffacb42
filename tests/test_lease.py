"""The run lease: one run per output folder, on local disk and on a real S3 server; a killed
run's lease is taken over (at once when its process is gone, else after it expires); a run
that lost its lease stops before committing. The two-`genrun`s-at-once case is in tests/chaos."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from generation_core.errors import GenrunError
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import (
    LEASE_DIR,
    LeaseFence,
    LeaseLost,
    LeaseRecord,
    RunLease,
    check_lease_free,
    newest_lease,
    this_machine,
)
from tests.conftest import REPO, S3_ENV

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["local", "s3"])
def folder(request, tmp_path):
    if request.param == "local":
        return StorageFolder(str(tmp_path / "run"))
    env = request.getfixturevalue("s3_server")
    return StorageFolder(
        f"s3://genrun-test/lease-{tmp_path.name}",
        {
            "endpoint_url": env["AWS_ENDPOINT_URL"],
            "key": S3_ENV["AWS_ACCESS_KEY_ID"],
            "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        },
    )


def test_a_second_run_is_refused_until_the_first_releases(folder):
    first = RunLease.acquire(folder, seconds=60)
    with pytest.raises(
        GenrunError,
        match=rf"output folder {folder.display()} is in use by another genrun run \(pid {os.getpid()} on host .*Wait for it to finish",
    ):
        RunLease.acquire(folder, seconds=60)
    with pytest.raises(GenrunError, match="in use by another genrun run"):
        check_lease_free(folder)
    first.release()
    check_lease_free(folder)
    with RunLease.acquire(folder, seconds=60) as second:
        assert second.record.generation == first.record.generation + 1
        # The new holder keeps only its predecessor's file, which says when that run ended.
        assert folder.list(LEASE_DIR) == [f"{first.record.generation:08d}.json", f"{second.record.generation:08d}.json"]
        previous = LeaseRecord(**folder.read_json(f"{LEASE_DIR}/{first.record.generation:08d}.json"))
        assert previous.released and previous.released_at <= second.record.acquired
    assert newest_lease(folder).released


def test_of_runs_racing_for_a_free_folder_exactly_one_wins(folder):
    start, results = threading.Barrier(6), []

    def contender():
        start.wait()
        try:
            results.append(RunLease.acquire(folder, seconds=60))
        except GenrunError as exc:
            results.append(exc)

    threads = [threading.Thread(target=contender) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [r for r in results if isinstance(r, RunLease)]
    assert len(winners) == 1, results
    assert all("in use by another genrun run" in str(r) for r in results if not isinstance(r, RunLease))
    winners[0].release()


def test_the_lease_of_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path):
    folder = StorageFolder(str(tmp_path / "run"))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom generation_core.store.lease import RunLease\nfrom generation_core.store.folder import StorageFolder\n"
            "RunLease.acquire(StorageFolder(sys.argv[1]), seconds=3600)\nprint('held', flush=True)\ntime.sleep(600)",
            folder.url,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(GenrunError, match=f"pid {holder.pid} "):
            RunLease.acquire(folder)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        # An hour-long lease, but its process is gone: no waiting.
        with RunLease.acquire(folder) as lease:
            assert lease.record.generation == 2
    finally:
        holder.kill()
        holder.wait()


def _plant(folder: StorageFolder, *, host: str, renewed_ago: float, seconds: float = 60) -> None:
    now = time.time()
    record = {
        "generation": 1,
        "owner": "x",
        "host": host,
        "pid": 1,
        "seconds": seconds,
        "acquired": now - renewed_ago,
        "renewed": now - renewed_ago,
        "released": False,
    }
    folder.put_atomic(f"{LEASE_DIR}/00000001.json", json.dumps(record).encode())


def test_a_lease_from_another_host_holds_until_it_expires(folder):
    _plant(folder, host="another-host", renewed_ago=5)
    with pytest.raises(
        GenrunError, match="another-host.*heartbeat 5 s ago; if that run was killed, its lease expires at"
    ):
        RunLease.acquire(folder)
    _plant(folder, host="another-host", renewed_ago=61)
    with RunLease.acquire(folder) as lease:
        assert lease.record.generation == 2


def test_a_lease_that_missed_its_heartbeats_is_waited_out_not_refused(tmp_path):
    folder = StorageFolder(str(tmp_path / "run"))
    _plant(folder, host="another-host", renewed_ago=6, seconds=8)
    started = time.monotonic()
    with RunLease.acquire(folder) as lease:
        waited = time.monotonic() - started
        assert lease.record.generation == 2
    # Taken over only once expired (2 s after the start), not refused, not taken early.
    assert waited >= 1.9, f"took over after {waited:.1f} s, before the lease expired"


def test_the_heartbeat_keeps_a_short_lease_alive(tmp_path):
    folder = StorageFolder(str(tmp_path / "run"))
    with RunLease.acquire(folder, seconds=4) as lease:
        time.sleep(5.5)
        record = newest_lease(folder)
        assert record.owner == lease.record.owner and record.renewed > record.acquired + 2
        assert record.state(time.time()) is None, "renewed: still held after more than its 4 s"


def test_a_run_that_lost_its_lease_stops_before_committing(tmp_path):
    from generation_core.inputs.shard_rows import ShardSpec
    from tests.shard_runs import run_shard
    from tests.test_shard import FakePrompts, ScriptedWorker, _cfg

    folder = StorageFolder(str(tmp_path / "run"))
    ours = RunLease.acquire(folder, seconds=60)
    fence = ours.fence()
    # Our heartbeat stalled past expiry and another run took the folder over.
    ours._stop.set()
    ours.record.renewed -= 120
    folder.put_atomic(f"{LEASE_DIR}/{ours.record.generation:08d}.json", json.dumps(ours.record.__dict__).encode())
    with RunLease.acquire(folder, seconds=60):
        cfg = _cfg("generation.save_batch_size=2")
        with pytest.raises(LeaseLost, match="taken over by another run"):
            run_shard(cfg, ShardSpec(0, 0, 4), folder, FakePrompts(ShardSpec(0, 0, 4)), ScriptedWorker(), fence)
    assert not folder.list("shards/shard-00000/commits"), "nothing committed after the takeover"
    assert LeaseFence(2).check(folder) is None


# --- a lost answer to the exclusive create (issue 17, item 6) -------------------------------------


class _LostAnswer:
    """fs.pipe_file whose first exclusive create gets no answer: the connection drops after the
    PUT (`store=True`: the object was stored; with `planted`: someone else's was) and s3fs
    raises a connection error, which StorageFolder retries."""

    def __init__(self, folder: StorageFolder, store: bool, planted: bytes | None = None):
        self.original, self.store, self.planted, self.fired = folder.fs.pipe_file, store, planted, 0

    def __call__(self, path, data, **kwargs):
        if kwargs.get("mode") == "create" and not self.fired:
            self.fired += 1
            if self.store:
                self.original(path, data, **kwargs)
            elif self.planted is not None:
                self.original(path, self.planted, **kwargs)
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return self.original(path, data, **kwargs)


@pytest.fixture
def s3_folder(s3_server, tmp_path):
    folder = StorageFolder(
        f"s3://genrun-test/lost-{tmp_path.name}",
        {
            "endpoint_url": s3_server["AWS_ENDPOINT_URL"],
            "key": S3_ENV["AWS_ACCESS_KEY_ID"],
            "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        },
    )
    folder.retry_delays = (0.05, 0.05)
    return folder


@pytest.mark.timeout(60)
def test_a_lease_whose_create_answer_was_lost_is_recognised_as_ours(s3_folder, monkeypatch):
    lost = _LostAnswer(s3_folder, store=True)
    monkeypatch.setattr(s3_folder.fs, "pipe_file", lost)
    with RunLease.acquire(s3_folder, seconds=60) as lease:
        assert lost.fired == 1 and lease.record.generation == 1
        assert s3_folder.list(LEASE_DIR) == ["00000001.json"]
        assert newest_lease(s3_folder).owner == lease.record.owner


@pytest.mark.timeout(60)
def test_a_lost_answer_does_not_make_another_runs_lease_ours(s3_folder, monkeypatch):
    now = time.time()
    theirs = {
        "generation": 1,
        "owner": "theirs",
        "host": "another-host",
        "pid": 7,
        "seconds": 60.0,
        "acquired": now,
        "renewed": now,
        "released": False,
    }
    lost = _LostAnswer(s3_folder, store=False, planted=json.dumps(theirs).encode())
    monkeypatch.setattr(s3_folder.fs, "pipe_file", lost)
    with pytest.raises(GenrunError, match="in use by another genrun run \\(pid 7 on host another-host"):
        RunLease.acquire(s3_folder, seconds=60)
    assert lost.fired == 1 and newest_lease(s3_folder).owner == "theirs"


# --- "this host" is this machine: boot id and pid namespace (issue 17, item 8) --------------------


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    return process.pid


def _plant_on_this_host(folder: StorageFolder, *, renewed_ago: float, **identity) -> None:
    """A lease of a process that no longer exists here, under this hostname."""
    now = time.time()
    record = {
        "generation": 1,
        "owner": "x",
        "host": socket.gethostname(),
        "pid": _dead_pid(),
        "seconds": 60.0,
        "acquired": now - renewed_ago,
        "renewed": now - renewed_ago,
        "released": False,
        **identity,
    }
    folder.put_atomic(f"{LEASE_DIR}/00000001.json", json.dumps(record).encode())


OTHER_MACHINES = {
    "another-machine-same-hostname": lambda boot, namespace: {
        "boot_id": "6f1c9a3e-0000-4000-8000-another-boot",
        "pid_namespace": namespace,
    },
    "another-container-on-this-machine": lambda boot, namespace: {"boot_id": boot, "pid_namespace": "pid:[4026530000]"},
    "a-lease-file-of-an-earlier-version": lambda boot, namespace: {},
    "a-lease-file-of-a-later-version": lambda boot, namespace: {
        "boot_id": "another-boot",
        "pid_namespace": namespace,
        "written_by": "genrun 9",
    },
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("identity", list(OTHER_MACHINES), ids=list(OTHER_MACHINES))
def test_a_lease_from_another_machine_with_this_hostname_holds_until_it_expires(tmp_path, identity):
    folder = StorageFolder(str(tmp_path / "run"))
    machine = OTHER_MACHINES[identity](*this_machine())
    _plant_on_this_host(folder, renewed_ago=5, **machine)
    # Its pid is gone here, which says nothing about a process on another machine (or in another
    # container's pid namespace): the lease holds.
    with pytest.raises(GenrunError, match=f"in use by another genrun run .* on host {socket.gethostname()}"):
        RunLease.acquire(folder)
    _plant_on_this_host(folder, renewed_ago=61, **machine)
    with RunLease.acquire(folder) as lease:
        assert lease.record.generation == 2


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="boot id and pid namespace from /proc")
def test_a_lease_records_this_machine_and_a_gone_owner_here_is_taken_over_at_once(tmp_path):
    folder = StorageFolder(str(tmp_path / "run"))
    with RunLease.acquire(folder) as lease:
        written = newest_lease(folder)
        assert written.boot_id == open("/proc/sys/kernel/random/boot_id").read().strip() == lease.record.boot_id
        assert written.pid_namespace == os.readlink("/proc/self/ns/pid")
    boot_id, namespace = this_machine()
    _plant_on_this_host(folder, renewed_ago=5, boot_id=boot_id, pid_namespace=namespace)
    with RunLease.acquire(folder) as lease:
        assert lease.record.generation == 2, "same host, boot and pid namespace, process gone: no waiting"


# --- lease/ removed by hand (issue 31, item 4) ----------------------------------------------------


@pytest.mark.timeout(120)
def test_a_folder_whose_lease_files_were_removed_resumes_exactly(tmp_path):
    """The refusal allows removing lease/; a new lease then numbers above every lease in the
    shards' commit records, so a folder resumed once (leases 1 and 2 in its records) resumes
    exactly instead of finding its shard claimed by a "later" run forever."""
    import shutil

    from generation_core.inputs.shard_rows import ShardSpec
    from tests.run_folder_helpers import committed_keys
    from tests.shard_runs import run_shard
    from tests.test_shard import FakePrompts, ScriptedWorker, _cfg

    run_dir = tmp_path / "run"
    folder = StorageFolder(str(run_dir))
    shard = ShardSpec(0, 0, 6)
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=1", "generation.max_failed_fraction=0.5")
    # Two runs whose sample 101:0 fails: the shard stays unfinished under lease 2.
    for generation in (1, 2):
        with RunLease.acquire(folder, seconds=60) as lease:
            assert lease.record.generation == generation
            run_shard(cfg, shard, folder, FakePrompts(shard), ScriptedWorker(fail_on=(101, 0)), lease.fence())
    shutil.rmtree(run_dir / LEASE_DIR)
    worker = ScriptedWorker()
    with RunLease.acquire(folder, seconds=60) as lease:
        assert lease.record.generation == 3, "numbered above the leases the commit records hold"
        manifest = run_shard(cfg, shard, folder, FakePrompts(shard), worker, lease.fence())
    assert worker.started == [(101, 0)], "exactly the one sample no record holds"
    assert manifest.num_trajectories == 6 and manifest.failures == 0
    assert sorted(committed_keys(run_dir, shard.name)) == sorted(f"{100 + p}:0" for p in range(6))
