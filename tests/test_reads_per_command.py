"""Each run read once per command (issue 53, item 3): `genrun status` on a running run lists
each shard's commit records once and reads each record once (one fold per shard, which the ETA
and stall lines share), and the example the run's last lines show reads one marker and one part,
no commit log. Counted through StorageFolder's reads on a local folder of a few shards; the
figures at 1,000 shards on the local S3 server: bench/RESULTS.md."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from generation_core.store.commit_log import ShardCheckpoint, write_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import RunLease
from generation_core.store.run_folder import COMMITS_DIR, PartEntry, SuccessMarker, shard_file, shard_name

pytestmark = pytest.mark.timeout(120)

SHARDS = 3
ROWS = 4


def count_reads(monkeypatch) -> tuple[Counter[str], Counter[str]]:
    """(listings, JSON reads) by relative path, of every StorageFolder from now on."""
    listings: Counter[str] = Counter()
    reads: Counter[str] = Counter()
    list_, read_json = StorageFolder.list, StorageFolder.read_json

    def counted_list(self: StorageFolder, relative: str) -> list[str]:
        listings[relative] += 1
        return list_(self, relative)

    def counted_read_json(self: StorageFolder, relative: str) -> Any:
        reads[relative] += 1
        return read_json(self, relative)

    monkeypatch.setattr(StorageFolder, "list", counted_list)
    monkeypatch.setattr(StorageFolder, "read_json", counted_read_json)
    return listings, reads


def write_run(folder: StorageFolder) -> None:
    """run.json of SHARDS shards of ROWS rows, one sample per prompt (bench/status_many_shards.py's)."""
    folder.put_json(
        "run.json",
        {
            "fingerprint": "f" * 64,
            "rollout_n": 1,
            "pad_token_id": 0,
            "shards": [{"name": shard_name(i), "range": [i * ROWS, (i + 1) * ROWS]} for i in range(SHARDS)],
            "config": {"actor_rollout_ref": {"rollout": {"prompt_length": 4, "response_length": 4}}, "generation": {}},
        },
    )


def test_status_of_a_running_run_lists_and_folds_each_shard_once(tmp_path, monkeypatch, capsys):
    """Shard 0 finished, shard 1 committed a part, shard 2 started: under the running run's lease,
    so the ETA line is computed from the same records the shard table was folded from."""
    from generation_core.outputs.status import print_status

    folder = StorageFolder(str(tmp_path / "run"))
    write_run(folder)
    with RunLease.acquire(folder, 60.0) as lease:
        fence = lease.fence()
        for i in range(SHARDS):
            checkpoint = ShardCheckpoint.start_attempt(folder, shard_name(i), fence)
            if i < 2:
                part = PartEntry(name="part-00000.parquet", count=ROWS, bytes=1, sha256="0" * 64)
                keys = [f"{n}:0" for n in range(i * ROWS, (i + 1) * ROWS)]
                checkpoint.commit_part(folder, shard_name(i), part, keys, fence=fence)
        span = [0, ROWS]
        write_marker(
            folder,
            SuccessMarker(shard_name(0), 0, span, num_trajectories=ROWS, expected_trajectories=ROWS, parts=[part]),
            fence,
        )
        listings, reads = count_reads(monkeypatch)
        assert print_status(folder.url) == 0
    out = capsys.readouterr().out
    assert "ETA " in out and "shards: 1 done, 1 running or interrupted, 0 failed, 1 pending; trajectories 8/12" in out
    commit_listings = {path: n for path, n in listings.items() if path.endswith(COMMITS_DIR)}
    assert commit_listings == {shard_file(shard_name(i), COMMITS_DIR): 1 for i in range(SHARDS)}
    record_reads = {path: n for path, n in reads.items() if f"/{COMMITS_DIR}/" in path}
    # attempt + part (+ done for shard 0) + attempt: each read once.
    assert sorted(record_reads.values()) == [1] * 6


def test_the_example_after_a_run_reads_one_marker_and_one_part_and_no_commit_log(tmp_path, monkeypatch):
    """The run's summary names its shards in order: the first with trajectories gives the part."""
    from flows.run_command import example_part

    folder = StorageFolder(str(tmp_path / "run"))
    write_run(folder)
    shards = []
    for i in range(SHARDS):
        part = PartEntry(name=f"part-0000{i}.parquet", count=ROWS if i else 0, bytes=1, sha256=str(i) * 64)
        checkpoint = ShardCheckpoint.start_attempt(folder, shard_name(i))
        if i:
            checkpoint.commit_part(folder, shard_name(i), part, [f"{n}:0" for n in range(i * ROWS, (i + 1) * ROWS)])
        count = ROWS if i else 0
        marker = SuccessMarker(
            shard_name(i),
            i,
            [i * ROWS, (i + 1) * ROWS],
            num_trajectories=count,
            expected_trajectories=ROWS,
            parts=[part] if i else [],
        )
        write_marker(folder, marker)
        shards.append({"shard": shard_name(i), "samples": count})
    listings, reads = count_reads(monkeypatch)
    ref = example_part(folder, {"shards": shards})
    assert ref is not None and (ref.path, ref.sha256) == (shard_file(shard_name(1), "part-00001.parquet"), "1" * 64)
    assert listings == Counter() and reads == Counter({shard_file(shard_name(1), "_SUCCESS.json"): 1})
    assert example_part(folder, {"shards": [dict(s, samples=0) for s in shards]}) is None
