"""The stall alarm and the ETA (issue 35, items 3 and 4): the alarm goes off once per stall and
names the shards concerned, on a real run whose engine stops answering; `genrun status` says
"stalled since ..." and the ETA from the run folder alone; the ETA takes the later of the run's
bound and each shard's own. The ETA's accuracy on a long-tailed run: bench/RESULTS.md."""

from __future__ import annotations

import contextlib
import io
import time
import types

import pytest

from generation_core.driver.stall_alarm import Stall, StallWatch, raise_alarm
from generation_core.shard.eta import ShardPace, estimate_eta
from tests.conftest import chat_rows, write_parquet

pytestmark = pytest.mark.timeout(180)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_the_alarm_goes_off_once_per_stall_and_names_the_running_shards():
    clock = Clock()
    watch = StallWatch(stall_seconds=60, clock=clock)
    a, b = ("t0", 0, 0), ("t1", 0, 0)
    assert watch.observe({"shard-00000": a, "shard-00001": b}) is None
    # shard 1 moves for a while, then nothing moves at all (the engines' first token count,
    # arriving meanwhile, is a baseline, not progress).
    for second in range(1, 31):
        clock.now += 1
        b = ("t1", second, 0)
        assert watch.observe({"shard-00000": a, "shard-00001": b}, engine_tokens=0) is None
    last_progress = clock.now
    alarms = []
    for _ in range(120):
        clock.now += 1
        alarm = watch.observe({"shard-00000": a, "shard-00001": b}, engine_tokens=0)
        if alarm is not None:
            alarms.append((clock.now, alarm))
    # Once, at 60 s without progress, naming the shards running.
    assert [(when - last_progress, alarm.since, alarm.shards) for when, alarm in alarms] == [
        (60.0, last_progress, ("shard-00000", "shard-00001"))
    ]
    assert "stalled: no trajectory committed and no token generated for 1m00s" in alarms[0][1].message()

    # Tokens generated count as progress (a long request still decoding): the alarm re-arms...
    clock.now += 1
    assert watch.observe({"shard-00000": a, "shard-00001": b}, engine_tokens=5) is None and watch.alarm is None
    clock.now += 59
    assert watch.observe({"shard-00000": a, "shard-00001": b}, engine_tokens=5) is None
    # ...shard 1 finishes (it leaves the running set: progress), and the next stall names shard 0 alone.
    clock.now += 1
    assert watch.observe({"shard-00000": a}, engine_tokens=5) is None
    clock.now += 60
    alarm = watch.observe({"shard-00000": a}, engine_tokens=5)
    assert alarm is not None and alarm.shards == ("shard-00000",) and alarm.seconds == 60.0


def test_the_alarm_goes_to_the_log_and_the_dispatchers_hook_and_a_failing_hook_stops_nothing(caplog):
    """Issue 44 item 4: the alarm is a log line plus the dispatcher's `on_stall` (the flow's
    Prefect artifact, or a library caller's own tracker); genrun sends no W&B alert itself."""
    seen: list[Stall] = []
    stall = Stall(since=1_000_000.0, seconds=300.0, shards=("shard-00002",))
    assert raise_alarm(stall, seen.append) is None
    assert seen == [stall] and [r.getMessage() for r in caplog.records] == [stall.message()]

    def broken(_stall):
        raise RuntimeError("Prefect API away")

    raise_alarm(stall, broken)
    assert caplog.records[-1].getMessage() == "could not pass on the stall alarm (RuntimeError: Prefect API away)"


def test_the_eta_is_the_later_of_the_runs_bound_and_each_shards_own():
    assert estimate_eta(0, 0, 0.0) == 0.0
    assert estimate_eta(100, 10, 1.0) is None  # under 2 s of rate: not measurable yet
    assert estimate_eta(100, 0, 10.0) is None
    # 300 left at the run's 10/s: 30 s, unless a shard's own rows take longer.
    assert estimate_eta(300, 100, 10.0, [ShardPace(remaining=150, done=50, seconds=10.0)]) == 30.0
    assert (
        estimate_eta(
            300,
            100,
            10.0,
            [ShardPace(remaining=250, done=50, seconds=10.0), ShardPace(remaining=50, done=50, seconds=10.0)],
        )
        == 50.0
    )


def test_a_run_whose_engine_stops_answering_raises_the_alarm_and_status_says_since_when(tmp_path, model_dir, ray_local):
    """The instant engine taking an hour per request: nothing is committed and no token is
    generated; the alarm fires once with the shard concerned, and `genrun status` on the folder
    (read while the run holds it) says stalled since when. Then the run is stopped."""
    from generation_core.driver.in_process import ShardsInThisProcess
    from generation_core.driver.run_driver import drive_run
    from generation_core.interrupt import STOP
    from generation_core.outputs.status import print_status
    from generation_core.preflight.preflight import preflight

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(4))
    out = tmp_path / "run"
    plan = preflight(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={out}",
            "actor_rollout_ref.rollout.name=instant",
            "actor_rollout_ref.rollout.engine_kwargs.instant.delay_seconds=3600",
            "generation.stall_seconds=3",
            "generation.show_progress=false",
        ]
    )
    alarms, status_out = [], io.StringIO()

    def on_stall(stall: Stall) -> None:
        alarms.append(stall)
        with contextlib.redirect_stdout(status_out):
            print_status(str(out))
        STOP.request()

    with STOP.handling():
        assert drive_run(plan, ShardsInThisProcess(plan), started=time.perf_counter(), on_stall=on_stall) is None
    assert len(alarms) == 1 and alarms[0].shards == ("shard-00000",) and alarms[0].seconds >= 3
    status = status_out.getvalue()
    assert "in use by a running genrun" in status
    stalled = [line for line in status.splitlines() if line.startswith("stalled since ")]
    assert len(stalled) == 1 and stalled[0].endswith("without a commit): shard-00000"), status
    assert "ETA - for 4 trajectories left" in status  # nothing committed: no rate yet


def test_status_on_a_running_run_gives_the_eta_from_its_commits_and_the_quiet_shards(tmp_path):
    """From the folder alone: shard 0 committed 6 of its 10 under the running run's lease and
    shard 1 nothing yet (started, quiet); shard 2 was not started by this run (no attempt of its
    lease: waiting for a worker, never called stalled)."""
    from generation_core.outputs.status import pace_lines, shard_states
    from generation_core.store.commit_log import ShardCheckpoint
    from generation_core.store.folder import StorageFolder
    from generation_core.store.lease import RunLease
    from generation_core.store.run_folder import PartEntry, read_run_record, shard_name

    folder = StorageFolder(str(tmp_path / "run"))
    folder.put_json(
        "run.json",
        {
            "fingerprint": "f" * 64,
            "rollout_n": 1,
            "pad_token_id": 0,
            "shards": [{"name": shard_name(i), "range": [i * 10, (i + 1) * 10]} for i in range(3)],
            "config": {
                "actor_rollout_ref": {"rollout": {"prompt_length": 4, "response_length": 4}},
                "generation": {"stall_seconds": 5},
            },
        },
    )
    with RunLease.acquire(folder, 60.0) as lease:
        fence = lease.fence()
        started = time.time()
        first = ShardCheckpoint.start_attempt(folder, shard_name(0), fence)
        first.commit_part(
            folder,
            shard_name(0),
            PartEntry(name="part-00000.parquet", count=6, bytes=1, sha256="0" * 64),
            [f"{i}:0" for i in range(6)],
            fence=fence,
        )
        ShardCheckpoint.start_attempt(folder, shard_name(1), fence)
        run = read_run_record(folder)
        records: dict = {}
        states = shard_states(folder, run, records)
        # 10 s after shard 0 started: 6 committed in 10 s (0.6/s) -> its 4 left take 6.7 s; the
        # run's 24 left at its 0.6/s take 40 s: the later bound.
        now = started + 10.0
        lines = pace_lines(folder, run, states, records, now=now)
        assert lines[0] == "ETA 40s for 24 trajectories left (from the commits of this run)"
        assert (
            len(lines) == 2
            and lines[1].startswith("stalled since ")
            and lines[1].endswith("without a commit): shard-00000, shard-00001")
        )
        # Within stall_seconds of their commits: an ETA, no stall line.
        assert [
            line for line in pace_lines(folder, run, states, records, now=started + 3.0) if line.startswith("stalled")
        ] == []
        # Issue 44 item 3: a GPU-hour price adds no cost to go (the ledger gives the run's cost once it finished).
        run.config["generation"]["gpu_hour_price"] = 2.0
        assert pace_lines(folder, run, states, records, now=now)[0] == lines[0]
    # No genrun holds the folder: an interrupted run is not a stalled one.
    assert pace_lines(folder, run, states, records, now=time.time()) == []


def test_the_flow_puts_the_alarm_in_the_flow_runs_log_and_an_artifact(monkeypatch):
    """flows/generate.py's on_stall: a warning in the flow run's log and a markdown artifact
    keyed by the experiment (the Prefect calls replaced: their own behaviour is Prefect's)."""
    import flows.generate as generate

    logged, artifacts = [], []
    monkeypatch.setattr(
        generate, "get_run_logger", lambda: types.SimpleNamespace(warning=lambda fmt, *args: logged.append(fmt % args))
    )
    monkeypatch.setattr(generate, "create_markdown_artifact", lambda **kwargs: artifacts.append(kwargs))
    stall = Stall(since=1_000_000.0, seconds=240.0, shards=("shard-00001",))
    tasks = types.SimpleNamespace(
        artifact_key="gen-abc", plan=types.SimpleNamespace(folder=types.SimpleNamespace(display=lambda: "/runs/x"))
    )
    generate.ShardTasksOnRay.stall_alarm(tasks, stall)  # type: ignore[arg-type]
    assert logged == [stall.message()]
    (artifact,) = artifacts
    assert (
        artifact["key"] == "gen-abc-stall"
        and stall.message() in artifact["markdown"]
        and "genrun status /runs/x" in artifact["markdown"]
    )
