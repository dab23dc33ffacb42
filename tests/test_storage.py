import os

from generation_core.records import TrajectoryRecord, records_from_parquet, records_to_parquet
from generation_core.storage import RunFolder


def test_put_atomic_leaves_no_temporary_files(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    folder.put_atomic("shards/shard-00000/a.bin", b"one")
    folder.put_atomic("shards/shard-00000/a.bin", b"two")
    assert folder.read_bytes("shards/shard-00000/a.bin") == b"two"
    assert os.listdir(tmp_path / "run" / "shards" / "shard-00000") == ["a.bin"]
    assert folder.list("shards") == ["shard-00000"]
    assert folder.list("missing") == []


def test_streaming_writer_commits_only_on_success(tmp_path):
    folder = RunFolder(str(tmp_path))
    try:
        with folder.open_write("big.bin") as handle:
            handle.write(b"partial")
            raise RuntimeError("crash mid-write")
    except RuntimeError:
        pass
    assert not folder.exists("big.bin")
    assert os.listdir(tmp_path) == []
    with folder.open_write("big.bin") as handle:
        handle.write(b"whole")
    assert folder.read_bytes("big.bin") == b"whole"


def test_records_round_trip_through_parquet():
    records = [
        TrajectoryRecord(3, 1, [1, 2, 3], [4, 5], [1, 0], [-0.5, 0.0], 1.5, 2, {"data_source": "x", "index": 3}, {"turn_scores": []}, {"generate_sequences": 0.1}),
        TrajectoryRecord(4, 0, [7], [], [], None, None, 2, {}, {}, {}),
    ]
    back = records_from_parquet(records_to_parquet(records))
    assert [r.__dict__ for r in back] == [r.__dict__ for r in records]
