"""Local storage failing mid-shard: a real full disk (a small tmpfs, where this machine lets us
mount one) and the same error injected under StorageFolder. The shard fails cleanly with a message
that says what to do, the committed parts and commit records stay intact, no temporary file is left
behind, and once there is space the next attempt resumes: every sample exactly once. S3 errors
(5xx retried, a refused PUT failing the shard) are in test_s3."""

import errno
import hashlib
import subprocess

import pytest

from generation_core.inputs.shard_rows import ShardSpec
from generation_core.store.folder import StorageFolder
from tests.merge_oracles import read_committed_records
from tests.run_folder_helpers import checkpoint_dict
from tests.shard_runs import run_shard
from tests.test_shard import FakePrompts, ScriptedWorker, _cfg

pytestmark = pytest.mark.timeout(120)

SHARD = ShardSpec(0, 0, 60)


class _DiskFullAfter:
    """The folder's disk fills up after `allowed` writes (whole files, commit records, streamed
    parts), until `free()`: a write then fails with ENOSPC where a full disk fails it."""

    def __init__(self, folder: StorageFolder, allowed: int):
        self.allowed, self.full = allowed, True
        self.write_local, self.open_write = folder._write_local, folder.open_write
        folder._write_local, folder.open_write = self._write_local, self._open_write

    def _room(self) -> bool:
        if self.full and self.allowed <= 0:
            return False
        self.allowed -= 1
        return True

    def _write_local(self, relative, data, publish):
        if not self._room():
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.write_local(relative, data, publish)

    def _open_write(self, relative):
        writer = self.open_write(relative)
        if not self._room():

            def full(data):
                raise OSError(errno.ENOSPC, "No space left on device")

            writer.write = full
        return writer

    def free(self):
        self.full = False


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(mount_point)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected disk-full case covers the same path")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _assert_intact(run_dir):
    shard_dir = run_dir / "shards" / "shard-00000"
    assert not [p.name for p in shard_dir.iterdir() if p.name.startswith(".tmp-")], "no temporary file left behind"
    checkpoint = checkpoint_dict(run_dir)
    for part in checkpoint["parts"]:
        assert hashlib.sha256((shard_dir / part["name"]).read_bytes()).hexdigest() == part["sha256"]
    return checkpoint


def _resume_and_check(cfg, folder, run_dir, committed_before):
    worker = ScriptedWorker()
    marker = run_shard(cfg, SHARD, folder, FakePrompts(SHARD), worker)
    assert len(worker.started) == 60 - committed_before, "only what was not committed runs again"
    assert marker.num_trajectories == 60
    completed = _assert_intact(run_dir)["completed"]
    assert sorted(completed) == sorted(f"{100 + p}:0" for p in range(60))
    assert len(read_committed_records(folder)) == 60


def test_a_real_full_disk_fails_the_shard_cleanly_and_the_retry_resumes(small_disk):
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=4")
    run_dir = small_disk / "run"
    folder = StorageFolder(str(run_dir))
    with pytest.raises(
        OSError, match="no space left on the device of .*free space there or choose another trainer.default_local_dir"
    ):
        run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    committed = len(_assert_intact(run_dir)["completed"])
    assert 0 < committed < 60
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    _resume_and_check(cfg, folder, run_dir, committed)


def test_an_injected_disk_full_fails_the_shard_cleanly_and_the_retry_resumes(tmp_path):
    cfg = _cfg("generation.save_batch_size=2", "generation.max_inflight=4")
    run_dir = tmp_path / "run"
    folder = StorageFolder(str(run_dir))
    disk = _DiskFullAfter(folder, allowed=9)
    with pytest.raises(OSError, match="(?i)no space left"):
        run_shard(cfg, SHARD, folder, FakePrompts(SHARD), ScriptedWorker())
    committed = len(_assert_intact(run_dir)["completed"])
    assert 0 < committed < 60
    disk.free()
    _resume_and_check(cfg, folder, run_dir, committed)
