"""Per-trajectory provenance and timings, and the capacity ledger (issue 35, items 1 and 2): a
run on the instant engine with two replicas stores each trajectory's replica, engine, seed,
attempt and time split in its part, carries them to the merged DataProto, and manifest.json's
ledger adds up to exactly what the trajectories say."""

from __future__ import annotations

import json

import pytest

from generation_core.outputs.padding import PROVENANCE_KEY, TIMINGS_KEY
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts
from generation_core.store.trajectory_record import records_from_parquet
from tests.conftest import chat_rows, write_parquet

pytestmark = pytest.mark.timeout(240)

PROMPTS = 12


@pytest.fixture(scope="module")
def finished_run(ray_local, tmp_path_factory):
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    tmp = tmp_path_factory.mktemp("ledger")
    prompts = write_parquet(tmp / "prompts.parquet", chat_rows(PROMPTS))
    out = tmp / "run"
    summary = run_in_process(
        preflight(
            [
                f"data.train_files={prompts}",
                f"trainer.default_local_dir={out}",
                "actor_rollout_ref.rollout.name=instant",
                "trainer.n_gpus_per_node=2",
                "generation.sample_seed=11",
                "generation.gpu_hour_price=3.0",
                "generation.save_batch_size=5",
                "generation.show_progress=false",
            ]
        )
    )
    return out, summary


def test_each_trajectory_carries_its_provenance_and_time_split_into_parts_and_the_merge(finished_run):
    out, _ = finished_run
    folder = StorageFolder(str(out))
    records = [r for part in committed_parts(folder) for r in records_from_parquet(folder.read_bytes(part.path))]
    assert sorted(r.key for r in records) == [(i, 0) for i in range(PROMPTS)]
    seeds = set()
    for record in records:
        p = record.provenance
        assert p is not None and record.timings is not None
        assert (p["engine"], p["attempt"], p["retries"]) == ("instant", 1, 0)
        assert len(p["sampling_digest"]) == 16 and p["model_digest"] and p["engine_version"] != "unknown"
        seeds.add(p["seed"])
        (turn,) = p["turns"]  # single-turn agent loop: one request
        assert (
            turn["replica"] is not None
            and turn["stop_reason"] == "stop"
            and turn["tokens"] == sum(record.response_mask)
        )
        # The instant engine reports no slot wait or prefill: null, and the request's time is decode.
        assert record.timings["slot_wait"] is None and record.timings["prefill"] is None
        assert record.timings["decode"] == pytest.approx(turn["seconds"], abs=1e-6)
        assert record.timings["reward"] is None
    assert len(seeds) == PROMPTS, "each sample its own seed"
    assert len({r.provenance["sampling_digest"] for r in records}) == 1

    from verl.protocol import DataProto

    merged = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    by_key = {r.key: r for r in records}
    provenance = merged.non_tensor_batch[PROVENANCE_KEY].tolist()
    timings = merged.non_tensor_batch[TIMINGS_KEY].tolist()
    for row, index in enumerate(merged.non_tensor_batch["index"].tolist()):
        assert provenance[row] == by_key[(index, 0)].provenance
        assert {k: v for k, v in timings[row].items() if k != "storage"} == by_key[(index, 0)].timings
        assert timings[row]["storage"] is not None and timings[row]["storage"] >= 0


def test_the_ledger_adds_up_to_what_the_trajectories_say(finished_run):
    out, summary = finished_run
    ledger = json.loads((out / "manifest.json").read_text())["ledger"]
    assert ledger == summary["ledger"]
    folder = StorageFolder(str(out))
    records = [r for part in committed_parts(folder) for r in records_from_parquet(folder.read_bytes(part.path))]
    turns = [t for r in records for t in r.provenance["turns"]]
    assert ledger["replicas"] == 2
    assert set(ledger["per_replica"]) == {t["replica"] for t in turns}
    assert sum(row["requests"] for row in ledger["per_replica"].values()) == len(turns) == PROMPTS
    assert (
        sum(row["output_tokens"] for row in ledger["per_replica"].values())
        == ledger["output_tokens"]
        == summary["generated_tokens"]
    )
    assert all(0 <= row["idle_fraction"] <= 1 for row in ledger["per_replica"].values())
    assert ledger["time_split_seconds"]["decode"] == pytest.approx(sum(r.timings["decode"] for r in records), abs=1e-3)
    assert ledger["replica_seconds"] == pytest.approx(2 * ledger["wall_seconds"], abs=1e-2)
    # A CPU replica counts as one device: 3.0 per device-hour.
    assert ledger["cost"] == pytest.approx(ledger["replica_seconds"] / 3600 * 3.0, rel=1e-3)
    assert ledger["cost_per_million_output_tokens"] == pytest.approx(
        ledger["cost"] / ledger["output_tokens"] * 1e6, rel=1e-3
    )
    assert ledger["prefix_cache_hit_rate"] is None, "the instant engine reports no prefix cache"
    assert "eta" not in ledger, "issue 44 item 1: the ledger keeps no ETA trace"
    # Issue 44 item 3: the lease says who holds the folder, not what it generates on or at what price.
    from generation_core.store.lease import newest_lease
    from generation_core.store.run_folder import lease_file

    holder = newest_lease(folder)
    assert holder is not None
    assert set(json.loads(folder.read_bytes(lease_file(holder.generation)))) == {
        "generation",
        "owner",
        "host",
        "pid",
        "seconds",
        "acquired",
        "renewed",
        "released",
        "released_at",
        "boot_id",
        "pid_namespace",
    }


def test_the_ledger_comes_from_the_parts_counters_and_equals_the_trajectories_own(finished_run):
    """Issue 53 item 4: finish adds up the counters each part's commit record carries (the markers
    list them) and reads no trajectory: the figures equal those folded from every trajectory's
    provenance (replica_activity takes the parts' entries, not the folder)."""
    from generation_core.outputs.ledger import ReplicaActivity, capacity_ledger, replica_activity
    from generation_core.store.commit_log import read_marker
    from generation_core.store.run_folder import SHARDS_DIR

    out, summary = finished_run
    ledger = summary["ledger"]
    folder = StorageFolder(str(out))
    markers = [read_marker(folder, shard) for shard in folder.list(SHARDS_DIR)]
    parts = [part for marker in markers for part in marker.parts]
    assert parts and all(part.activity is not None for part in parts)
    records = [r for part in committed_parts(folder) for r in records_from_parquet(folder.read_bytes(part.path))]
    by_trajectory = ReplicaActivity()
    for record in records:
        by_trajectory.add_trajectory(record.provenance, since=0.0)
        for name, seconds in record.timings.items():
            by_trajectory.time_split[name] += seconds or 0.0
    by_trajectory.time_split["storage"] = sum(part.storage_seconds for part in parts)
    layout = dict(
        wall_seconds=ledger["wall_seconds"],
        replicas=ledger["replicas"],
        gpus_per_replica=ledger["gpus_per_replica"],
        output_tokens=ledger["output_tokens"],
        gpu_hour_price=ledger["gpu_hour_price"],
    )
    expected = capacity_ledger(by_trajectory, **layout)
    assert capacity_ledger(replica_activity(parts), **layout) == expected
    assert {
        key: value
        for key, value in ledger.items()
        if key not in ("wall_seconds", "replica_seconds", "gpu_seconds", "cost", "cost_per_million_output_tokens")
    } == {
        key: value
        for key, value in expected.items()
        if key not in ("wall_seconds", "replica_seconds", "gpu_seconds", "cost", "cost_per_million_output_tokens")
    }


def test_a_part_keeps_few_busy_spans_and_its_busy_seconds_bound_the_union():
    """A part's commit record keeps at most BUSY_SPANS spans per replica (joined across the
    shortest gaps); the ledger's busy time is then the smaller of their union and the sum of the
    parts' own busy seconds, so a replica that ran one part at a time stays exact."""
    from generation_core.outputs.ledger import capacity_ledger, replica_activity
    from generation_core.store.run_folder import BUSY_SPANS, PartActivity, PartEntry

    def part(first_start: float) -> PartEntry:
        counted = PartActivity()
        for turn in range(3 * BUSY_SPANS):  # 0.1 s turns 1 s apart: 48 spans of one replica
            counted.add(
                {"started_at": first_start, "turns": [{"replica": "r0", "start": turn, "seconds": 0.1, "tokens": 2}]},
                {"decode": 0.1},
            )
        return PartEntry(name="p", count=3 * BUSY_SPANS, bytes=0, sha256="", activity=counted.to_dict())

    first, second = part(1000.0), part(2000.0)
    assert len(first.activity["busy"]["r0"]) == BUSY_SPANS and first.activity["busy_seconds"]["r0"] == pytest.approx(
        4.8
    )
    assert first.activity["busy"]["r0"][0][0] == 1000.0 and first.activity["busy"]["r0"][-1][1] == pytest.approx(1047.1)
    ledger = capacity_ledger(
        replica_activity([first, second], since=1500.0),
        wall_seconds=1.0,
        replicas=1,
        gpus_per_replica=0,
        output_tokens=0,
        gpu_hour_price=None,
    )
    # Only the part started since `since` counts per replica; both count in the time split.
    assert (
        ledger["per_replica"]["r0"]["requests"] == 3 * BUSY_SPANS
        and ledger["per_replica"]["r0"]["output_tokens"] == 6 * BUSY_SPANS
    )
    assert ledger["per_replica"]["r0"]["busy_seconds"] == pytest.approx(4.8)
    assert ledger["generation_window_seconds"] == pytest.approx(47.1)
    assert ledger["time_split_seconds"]["decode"] == pytest.approx(2 * 4.8)


def test_status_shows_the_ledger(finished_run, capsys):
    from generation_core.outputs.status import print_status

    out, _ = finished_run
    assert print_status(str(out)) == 0
    text = capsys.readouterr().out
    assert "capacity:      2 replica(s)" in text and "time split:" in text and "at 3/GPU-hour" in text
    assert "ETA" not in text
    from generation_core.outputs.ledger import ledger_lines

    ledger = json.loads((out / "manifest.json").read_text())["ledger"]
    # Issue 45 item 7: GPU replicas are counted in GPU-seconds; CPU ones are said to be on the CPU.
    on_cpu = ledger_lines(ledger)[0]
    assert ledger["gpus_per_replica"] == 0 and on_cpu.endswith("replica-s (on the CPU)") and "GPU" not in on_cpu, on_cpu
    assert ledger_lines(dict(ledger, gpus_per_replica=1, gpu_seconds=12.0))[0].endswith("replica-s (12.0 GPU-s)")


def test_the_report_shows_the_ledger_and_the_viewer_knows_each_trajectorys_replica_and_time(finished_run):
    import re

    from generation_core.report.html import REPORT_FILE, write_report

    out, summary = finished_run
    report = write_report(StorageFolder(str(out)))
    assert {"replica-timeline", "time-split"} <= {plot.name for plot in report.plots}
    assert "eta" not in {plot.name for plot in report.plots}
    page = (out / REPORT_FILE).read_text()
    assert "ETA error" not in page
    table = re.search(r'<table id="replica-table">.*?<tbody>(.*?)</tbody>', page, re.S).group(1)
    assert [re.findall(r"<td[^>]*>(.*?)</td>", row)[0] for row in re.findall(r"<tr>(.*?)</tr>", table)] == sorted(
        summary["ledger"]["per_replica"]
    )
    payload = json.loads(
        re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', page, re.S).group(1)
    )
    folder = StorageFolder(str(out))
    records = {
        f"{r.index}:{r.rollout_n}": r
        for part in committed_parts(folder)
        for r in records_from_parquet(folder.read_bytes(part.path))
    }
    assert len(payload["trajectories"]) == PROMPTS
    for shown in payload["trajectories"]:
        record = records[shown["id"]]
        assert shown["replicas"] == [record.provenance["turns"][0]["replica"]]
        assert shown["time"]["decode"] == round(record.timings["decode"], 4) and shown["time"]["prefill"] is None
