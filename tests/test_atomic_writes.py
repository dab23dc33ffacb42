"""Failed writes publish nothing (issue 17, item 1): an exception in the middle of any write
through StorageFolder, local or S3 (a real S3 API: moto on 127.0.0.1), leaves the previous file, or
its absence, exactly as it was, and no temporary file or unfinished multipart upload behind.
Each kind of write the pipeline makes is broken half way through its real call site: the merged
pickle (merge_run), a chunk and the chunk index (merge_run_chunked), and the zip (write_zip)."""

import errno
import io
import os
import zipfile

import pytest

import generation_core.driver.publish as publish
import generation_core.outputs.merge as merge
from generation_core.outputs.merge import merge_run, merge_run_chunked
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import CHUNK_INDEX_FILE, MERGED_FILE, ZIP_FILE, chunk_file_name
from tests.conftest import S3_ENV
from tests.test_merge import _lengths, _random_records, _write_run

pytestmark = pytest.mark.timeout(120)

BLOCK = 5 * 2**20  # the smallest S3 part: big writes upload parts before the block ends


@pytest.fixture(params=["local", "s3"])
def folder(request, tmp_path):
    if request.param == "local":
        return StorageFolder(str(tmp_path / "run"))
    env = request.getfixturevalue("s3_server")
    options = {
        "endpoint_url": env["AWS_ENDPOINT_URL"],
        "key": S3_ENV["AWS_ACCESS_KEY_ID"],
        "secret": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "default_block_size": BLOCK,
    }
    folder = StorageFolder(f"s3://genrun-test/atomic-{tmp_path.name}", options)
    folder.retry_delays = (0.05,)
    return folder


def _snapshot(folder: StorageFolder) -> dict[str, bytes]:
    """Every file under the folder with its bytes."""
    if not folder.fs.exists(folder.root):
        return {}
    return {path[len(folder.root) + 1 :]: folder.fs.cat_file(path) for path in sorted(folder.fs.find(folder.root))}


def _assert_nothing_left_over(folder: StorageFolder) -> None:
    if folder.is_local:
        leftovers = [name for _, _, names in os.walk(folder.root) for name in names if name.startswith(".tmp-")]
        assert not leftovers, f"temporary files left behind: {leftovers}"
    else:
        bucket, prefix = folder.root.split("/", 1)
        uploads = folder.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
        assert not uploads, f"unfinished multipart uploads left behind: {uploads}"


class HalfWrite(OSError):
    pass


def _dump_half_then_fail(real_dump, pad: int = 0):
    """merge.dump_dataproto that writes half of the real pickle (and `pad` more bytes) to the
    handle, then fails: a crash in the middle of the stream."""

    def dump(data, handle):
        whole = io.BytesIO()
        real_dump(data, whole)
        handle.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        handle.write(b"\0" * pad)
        raise HalfWrite(errno.EIO, "the disk went away half way through the pickle")

    return dump


def _merged_run(folder: StorageFolder) -> None:
    _write_run(folder, _random_records(9))
    folder.put_json("run.json", {"fingerprint": "f" * 64})
    folder.put_json("manifest.json", {"rows": 9})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("previous", [True, False], ids=["over-a-previous-file", "no-previous-file"])
def test_a_merge_that_fails_half_way_leaves_the_previous_pickle(folder, monkeypatch, previous):
    _merged_run(folder)
    if previous:
        merge_run(folder, **_lengths())
    before = _snapshot(folder)
    # Past one S3 part on S3: parts were uploaded before the failure and must be discarded.
    monkeypatch.setattr(
        merge, "dump_dataproto", _dump_half_then_fail(merge.dump_dataproto, pad=0 if folder.is_local else BLOCK + 1)
    )
    with pytest.raises(HalfWrite):
        merge_run(folder, **_lengths())
    assert _snapshot(folder) == before, "a failed merge changed the folder"
    assert folder.exists(MERGED_FILE) == previous
    _assert_nothing_left_over(folder)


@pytest.mark.timeout(60)
def test_a_chunk_that_fails_half_way_leaves_the_previous_chunk(folder, monkeypatch):
    _merged_run(folder)
    merge_run_chunked(folder, chunk_size=3, **_lengths())
    chunks_before = {name: folder.read_bytes(name) for name in (chunk_file_name(n) for n in range(3))}
    real_dump, calls = merge.dump_dataproto, []
    half = _dump_half_then_fail(real_dump)

    def second_chunk_fails(data, handle):
        calls.append(len(data))
        return real_dump(data, handle) if len(calls) == 1 else half(data, handle)

    monkeypatch.setattr(merge, "dump_dataproto", second_chunk_fails)
    with pytest.raises(HalfWrite):
        merge_run_chunked(folder, chunk_size=3, **_lengths())
    # Chunk 0 was rewritten whole (same rows, same bytes); chunk 1, broken half way, is the old one.
    assert {name: folder.read_bytes(name) for name in chunks_before} == chunks_before
    # The merge removes the index before it rewrites chunks (test_merge): no index, no half index.
    assert not folder.exists(CHUNK_INDEX_FILE)
    _assert_nothing_left_over(folder)


@pytest.mark.timeout(60)
def test_a_chunk_index_that_fails_half_way_is_not_published(folder, monkeypatch):
    _merged_run(folder)
    broken = True
    if folder.is_local:
        # The index is written whole to a temporary file; fail its fsync, after the bytes went out.
        real_fsync = os.fsync

        def fsync(descriptor):
            if broken and CHUNK_INDEX_FILE in os.readlink(f"/proc/self/fd/{descriptor}"):
                raise HalfWrite(errno.EIO, "the disk went away half way through the index")
            return real_fsync(descriptor)

        monkeypatch.setattr(os, "fsync", fsync)
    else:
        real_pipe = folder.fs.pipe_file

        def pipe_file(path, data, **kwargs):
            if broken and path.endswith(CHUNK_INDEX_FILE):
                raise HalfWrite(errno.EIO, "the connection dropped half way through the index")
            return real_pipe(path, data, **kwargs)

        monkeypatch.setattr(folder.fs, "pipe_file", pipe_file)
    with pytest.raises(HalfWrite):
        merge_run_chunked(folder, chunk_size=4, **_lengths())
    assert not folder.exists(CHUNK_INDEX_FILE)
    _assert_nothing_left_over(folder)
    # Over a previous index the failed write leaves it as it was.
    broken = False
    folder.put_json(CHUNK_INDEX_FILE, {"chunks": []})
    before = folder.read_bytes(CHUNK_INDEX_FILE)
    broken = True
    with pytest.raises(HalfWrite):
        folder.put_json(CHUNK_INDEX_FILE, {"chunks": [{"name": "x"}] * 1000})
    assert folder.read_bytes(CHUNK_INDEX_FILE) == before
    _assert_nothing_left_over(folder)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("previous", [True, False], ids=["over-a-previous-zip", "no-previous-zip"])
def test_a_zip_that_fails_half_way_leaves_the_previous_zip(folder, monkeypatch, previous):
    _merged_run(folder)
    merge_run(folder, **_lengths())
    if previous:
        publish.write_zip(folder)
        assert zipfile.ZipFile(io.BytesIO(folder.read_bytes(ZIP_FILE))).testzip() is None
    before = _snapshot(folder)
    real_copy = publish.shutil.copyfileobj

    def copy_half_then_fail(source, target, length=0):
        data = source.read()
        target.write(data[: len(data) // 2])
        raise HalfWrite(errno.EIO, "reading the merged output failed half way")

    monkeypatch.setattr(publish.shutil, "copyfileobj", copy_half_then_fail)
    with pytest.raises(HalfWrite):
        publish.write_zip(folder)
    monkeypatch.setattr(publish.shutil, "copyfileobj", real_copy)
    # zipfile writes a valid-looking central directory on the way out: none of it may land.
    assert _snapshot(folder) == before, "a failed zip changed the folder"
    assert folder.exists(ZIP_FILE) == previous
    _assert_nothing_left_over(folder)


@pytest.mark.timeout(60)
def test_a_streamed_write_lands_whole_only_when_its_block_succeeds(folder):
    """The storage layer itself: a write larger than several S3 parts, broken after two of them."""
    folder.put_atomic("big.bin", b"previous")
    with pytest.raises(HalfWrite):
        with folder.open_write("big.bin") as handle:
            handle.write(b"x" * (2 * BLOCK + 7))
            raise HalfWrite(errno.EIO, "the producer failed")
    assert folder.read_bytes("big.bin") == b"previous"
    with pytest.raises(HalfWrite):
        with folder.open_write("new.bin") as handle:
            handle.write(b"y" * 10)
            raise HalfWrite(errno.EIO, "the producer failed")
    assert not folder.exists("new.bin")
    _assert_nothing_left_over(folder)
    payload = os.urandom(2 * BLOCK + 11)
    with folder.open_write("big.bin") as handle:
        handle.write(payload)
    with folder.open_write("empty.bin"):
        pass
    assert folder.read_bytes("big.bin") == payload and folder.read_bytes("empty.bin") == b""
    _assert_nothing_left_over(folder)
