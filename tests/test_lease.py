"""The run lease: one run per output folder, on local disk and on a real S3 server; a killed
run's lease is taken over (at once when its process is gone, else after it expires); a run
that lost its lease stops before committing. The two-`genrun`s-at-once case is in tests/chaos."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from generation_core.errors import GenrunError
from generation_core.lease import LEASE_DIR, LeaseFence, LeaseLost, LeaseRecord, RunLease, check_lease_free, newest_lease
from generation_core.storage import RunFolder
from tests.conftest import REPO, S3_ENV

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["local", "s3"])
def folder(request, tmp_path):
    if request.param == "local":
        return RunFolder(str(tmp_path / "run"))
    env = request.getfixturevalue("s3_server")
    return RunFolder(f"s3://genrun-test/lease-{tmp_path.name}", {"endpoint_url": env["AWS_ENDPOINT_URL"], "key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"]})


def test_a_second_run_is_refused_until_the_first_releases(folder):
    first = RunLease.acquire(folder, seconds=60)
    with pytest.raises(GenrunError, match=rf"output folder {folder.display()} is in use by another genrun run \(pid {os.getpid()} on host .*Wait for it to finish"):
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
    folder = RunFolder(str(tmp_path / "run"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom generation_core.lease import RunLease\nfrom generation_core.storage import RunFolder\n"
         "RunLease.acquire(RunFolder(sys.argv[1]), seconds=3600)\nprint('held', flush=True)\ntime.sleep(600)", folder.url],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
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


def _plant(folder: RunFolder, *, host: str, renewed_ago: float, seconds: float = 60) -> None:
    now = time.time()
    record = {"generation": 1, "owner": "x", "host": host, "pid": 1, "seconds": seconds, "acquired": now - renewed_ago, "renewed": now - renewed_ago, "released": False}
    folder.put_atomic(f"{LEASE_DIR}/00000001.json", json.dumps(record).encode())


def test_a_lease_from_another_host_holds_until_it_expires(folder):
    _plant(folder, host="another-host", renewed_ago=5)
    with pytest.raises(GenrunError, match="another-host.*heartbeat 5 s ago; if that run was killed, its lease expires at"):
        RunLease.acquire(folder)
    _plant(folder, host="another-host", renewed_ago=61)
    with RunLease.acquire(folder) as lease:
        assert lease.record.generation == 2


def test_a_lease_that_missed_its_heartbeats_is_waited_out_not_refused(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    _plant(folder, host="another-host", renewed_ago=6, seconds=8)
    started = time.monotonic()
    with RunLease.acquire(folder) as lease:
        waited = time.monotonic() - started
        assert lease.record.generation == 2
    # Taken over only once expired (2 s after the start), not refused, not taken early.
    assert waited >= 1.9, f"took over after {waited:.1f} s, before the lease expired"


def test_the_heartbeat_keeps_a_short_lease_alive(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    with RunLease.acquire(folder, seconds=4) as lease:
        time.sleep(5.5)
        record = newest_lease(folder)
        assert record.owner == lease.record.owner and record.renewed > record.acquired + 2
        assert record.state(time.time()) is None, "renewed: still held after more than its 4 s"


def test_a_run_that_lost_its_lease_stops_before_committing(tmp_path):
    from tests.test_shard import FakePrompts, ScriptedWorker, _cfg
    from generation_core.data import ShardSpec
    from generation_core.job import run_shard

    folder = RunFolder(str(tmp_path / "run"))
    ours = RunLease.acquire(folder, seconds=60)
    fence = ours.fence()
    # Our heartbeat stalled past expiry and another run took the folder over.
    ours._stop.set()
    ours.record.renewed -= 120
    folder.put_atomic(f"{LEASE_DIR}/{ours.record.generation:08d}.json", json.dumps(ours.record.__dict__).encode())
    with RunLease.acquire(folder, seconds=60):
        cfg = _cfg("generation.save_batch_size=2")
        with pytest.raises(LeaseLost, match="taken over by another run"):
            asyncio.run(run_shard(cfg, ShardSpec(0, 0, 4), folder, FakePrompts(), ScriptedWorker(), fence))
    assert not folder.exists("shards/shard-00000/checkpoint.json"), "nothing committed after the takeover"
    assert LeaseFence(2).check(folder) is None
