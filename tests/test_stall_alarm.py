"""The stall alarm and the ETA (issue 35, items 3 and 4): the alarm goes off once per stall and
names the shards concerned, on a real run whose engine stops answering; `genrun status` says
"stalled since ..." and the ETA from the run folder alone; the ETA takes the later of the run's
bound and each shard's own. The ETA's accuracy on a long-tailed run is measured by bench/eta.py."""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
import time
import types

import pytest

from generation_core.driver.stall_alarm import Stall, StallWatch, raise_alarm
from generation_core.shard.eta import Durations, ShardPace, estimate_eta
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


def test_the_alarm_reaches_the_dispatcher_and_wandb_and_a_failing_one_stops_nothing(monkeypatch, caplog):
    alerts, seen = [], []

    class Run:
        def alert(self, **kwargs):
            alerts.append(kwargs)

        def finish(self):
            alerts.append("finished")

    fake = types.SimpleNamespace(run=None, init=lambda **kwargs: alerts.append(kwargs) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    stall = Stall(since=1_000_000.0, seconds=300.0, shards=("shard-00002",))
    sender = raise_alarm(stall, seen.append, ("genrun", "exp-1"))
    assert sender is not None
    sender.join(timeout=30)
    assert seen == [stall]
    init, alert, finished = alerts
    assert init["project"] == "genrun" and init["name"] == "exp-1"
    assert alert["level"] == "WARN" and "shard-00002" in alert["text"] and finished == "finished"
    assert "stalled:" in caplog.text

    def broken(_stall):
        raise RuntimeError("Prefect API away")

    raise_alarm(stall, broken, None)
    assert "could not pass on the stall alarm (RuntimeError: Prefect API away)" in caplog.text


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


def test_with_the_durations_the_eta_adds_the_drain_of_the_trajectories_still_open():
    """A rate says when the last trajectory starts; the run ends when the longest open one ends.
    Every trajectory taking d: one seen in flight has d x U(0, 1) left, the longest of n such
    d x n / (n + 1) (d: its histogram bin's middle)."""
    durations = Durations()
    assert durations.expected_longest(4) == 0.0, "no data: no drain"
    for _ in range(10):
        durations.add(2.0)
    d = Durations.middle(Durations.bin_of(2.0))
    assert abs(d - 2.0) / 2.0 < 0.12, "a bin's middle is within 12% of what it holds"
    assert durations.expected_longest(1) == pytest.approx(d / 2)
    assert durations.expected_longest(3) == pytest.approx(d * 3 / 4)
    assert durations.expected_longest(0) == 0.0
    # 300 left at 10/s, 16 of them open: 284 start over 28.4 s, then the longest of 16 drains.
    pace = ShardPace(remaining=300, done=100, seconds=10.0, open_now=16)
    assert estimate_eta(300, 100, 10.0, [pace], durations) == pytest.approx(28.4 + d * 16 / 17)
    # The end: 5 left, all open: the longest of the 5 (not 5 at the rate).
    assert estimate_eta(
        5, 395, 40.0, [ShardPace(remaining=5, done=395, seconds=40.0, open_now=8)], durations
    ) == pytest.approx(d * 5 / 6)
    # Exponential times (mean 1): the longest residual of n is the n-th harmonic number.
    rng, exponential = random.Random(7), Durations()
    for _ in range(50_000):
        exponential.add(rng.expovariate(1.0))
    assert exponential.expected_longest(10) == pytest.approx(sum(1 / i for i in range(1, 11)), rel=0.03)
    # A report's histogram that went through JSON (string keys) adds up the same.
    merged = Durations()
    merged.merge(json.loads(json.dumps(durations.counts)))
    assert merged.counts == durations.counts


def test_a_shard_reporter_reports_how_long_its_trajectories_took():
    from generation_core.shard.progress import ShardReporter

    reporter = ShardReporter(None, 0)
    reporter.finished(1, {"started_at": time.time() - 2.0})
    reporter.finished(2, None)  # a record without provenance: counted, not timed
    assert reporter.report.generated == 2
    assert reporter.report.durations == {Durations.bin_of(2.0): 1}


def test_a_run_whose_engine_stops_answering_raises_the_alarm_and_status_says_since_when(tmp_path, model_dir, ray_local):
    """The instant engine taking an hour per request: nothing is committed and no token is
    generated; the alarm fires once with the shard concerned, and `genrun status` on the folder
    (read while the run holds it) says stalled since when. Then the run is stopped."""
    from generation_core.driver.in_process import ShardsInThisProcess
    from generation_core.driver.run_driver import drive_run
    from generation_core.interrupt import STOP
    from generation_core.outputs.status import print_status
    from generation_core.plan.preflight import preflight

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
    from dataclasses import asdict

    from generation_core.outputs.pace import pace_lines
    from generation_core.outputs.status import shard_states
    from generation_core.store.commit_log import ShardCheckpoint
    from generation_core.store.folder import StorageFolder
    from generation_core.store.lease import RunLease
    from generation_core.store.run_folder import PartEntry, lease_file, read_run_record, shard_name

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
        states = shard_states(folder, run)
        # 10 s after shard 0 started: 6 committed in 10 s (0.6/s) -> its 4 left take 6.7 s; the
        # run's 24 left at its 0.6/s take 40 s: the later bound.
        now = started + 10.0
        lines = pace_lines(folder, run, states, now=now)
        assert lines[0] == "ETA 40s for 24 trajectories left (from the commits of this run)"
        assert (
            len(lines) == 2
            and lines[1].startswith("stalled since ")
            and lines[1].endswith("without a commit): shard-00000, shard-00001")
        )
        # Within stall_seconds of their commits: an ETA, no stall line.
        assert [line for line in pace_lines(folder, run, states, now=started + 3.0) if line.startswith("stalled")] == []
        # With a GPU-hour price: what the rest costs, 8 GPUs held for the 40 s left at 2.0 per GPU-hour.
        run.config["generation"]["gpu_hour_price"] = 2.0
        run.config["trainer"] = {"n_gpus_per_node": 8, "nnodes": 1}
        assert (
            pace_lines(folder, run, states, now=now)[0]
            == "ETA 40s for 24 trajectories left (from the commits of this run); ~0.178 to go at 2/GPU-hour"
        )
        # That was run.json's (the first invocation's) config, which a lease of an older genrun
        # leaves to go by. A lease that says what its run generates on and at what price wins:
        # a resume may hold other devices and set another price. 2 devices x 40 s at 9.0.
        lease.record.devices, lease.record.gpu_hour_price = 2, 9.0
        folder.put_json(lease_file(lease.record.generation), asdict(lease.record))
        assert (
            pace_lines(folder, run, states, now=now)[0]
            == "ETA 40s for 24 trajectories left (from the commits of this run); ~0.2 to go at 9/GPU-hour"
        )
    # No genrun holds the folder: an interrupted run is not a stalled one.
    assert pace_lines(folder, run, states, now=time.time()) == []


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


def test_the_instant_engines_long_tail_is_seeded_by_the_request():
    """engine_kwargs.instant.delay_sigma (bench/eta.py's long-tailed runs): each request's delay
    and length scale by one log-normal factor drawn from the request, the same every time."""
    import asyncio

    from generation_core.engines.instant import InstantEngine, InstantSettings

    engine = InstantEngine(
        InstantSettings(prompt_length=64, response_length=4096, eos_token_id=2, response_tokens=16, delay_sigma=1.0)
    )

    def lengths() -> list[int]:
        async def all_of() -> list[int]:
            outputs = [
                await engine.generate("r", prompt_ids=[5, 6, i], sampling_params={"temperature": 0}) for i in range(400)
            ]
            return [len(output.token_ids) for output in outputs]

        return asyncio.run(all_of())

    first = lengths()
    assert first == lengths()
    ordered = sorted(first)
    # Median ~16 tokens; a long tail: the slowest 1% at several times the median.
    assert 12 <= ordered[200] <= 20 and ordered[396] >= 4 * ordered[200] and ordered[0] >= 1
