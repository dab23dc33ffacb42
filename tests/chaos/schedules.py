"""Seeded random fault schedules over real `genrun` runs, and the invocation driver.

A schedule is a list of invocations of the same command on the same output folder. The first
ones are killed (-9) at a random moment; one runs with several faults that the run must
survive (shard worker killed, a replica killed, a crash between a part write and its
checkpoint, a full disk, a second run started on the same folder); between invocations a
committed part may be damaged; then the same command is run until it succeeds (at most twice:
a corruption of a finished shard that only the merge can see costs one more run). Faults hit
real processes by PID; the ones a timer cannot aim at a window use failpoints
(generation_core/instrumentation.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import GENRUN, REPO, kill_group

# Faults a run survives within one invocation, and where each one is aimed.
SURVIVABLE = ("kill_shard_worker", "kill_replica", "crash_after_part_write", "disk_full", "concurrent_run")
# Moments after which a kill -9 of the whole run may land ("start": anywhere from the beginning).
KILL_TRIGGERS = ("start", "ray_ready", "engine_ready", "part_written")
BETWEEN_RUNS = ("truncate_part", "flip_part_byte", "delete_part")


@dataclass
class Fault:
    kind: str
    trigger: str = "start"
    delay: float = 0.0
    hit: int = 1


@dataclass
class Invocation:
    faults: list[Fault] = field(default_factory=list)
    damage_before: str | None = None


def make_schedule(seed: int) -> list[Invocation]:
    rng = random.Random(seed)
    # Whether a kill of the run is timed or lands exactly after a part write (own stream, so
    # the other draws of a seed stay what they were).
    exact = random.Random(f"{seed}-exact")
    schedule = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        trigger = rng.choice(KILL_TRIGGERS)
        delay = rng.uniform(2.0, 30.0) if trigger == "start" else rng.uniform(0.0, 4.0)
        if exact.random() < 0.4:
            schedule.append(Invocation([Fault("kill_run_after_part_write", hit=exact.randint(1, 4))]))
        else:
            schedule.append(Invocation([Fault("kill_run", trigger, delay)]))
    survivable = rng.sample(SURVIVABLE, rng.randint(2, 5))
    faults = []
    for kind in survivable:
        if kind == "crash_after_part_write":
            faults.append(Fault(kind, hit=rng.randint(1, 3)))
        elif kind == "disk_full":
            faults.append(Fault(kind, hit=rng.randint(1, 4)))
        elif kind == "concurrent_run":
            faults.append(Fault(kind, "engine_ready", rng.uniform(0.0, 2.0)))
        else:
            faults.append(Fault(kind, rng.choice(("engine_ready", "part_written")), rng.uniform(0.0, 3.0)))
    schedule.append(Invocation(faults))
    schedule.append(Invocation(damage_before=rng.choice(BETWEEN_RUNS) if rng.random() < 0.7 else None))
    return schedule


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    injected: list[str]
    concurrent_refused: int = 0
    concurrent_not_refused: int = 0
    concurrent_after_finish: int = 0


def timeline_events(path: Path) -> list[tuple[str, int, float]]:
    """(event, pid, time) lines that processes of the run wrote (generation_core/instrumentation.py)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        match = re.match(r"(\S+).* pid=(\d+) (\S+)$", line)
        if match:
            events.append((match.group(1), int(match.group(2)), float(match.group(3))))
    return events


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


class InvocationDriver:
    """Runs one `genrun` and lands its faults when their trigger events appear."""

    def __init__(self, args: list[str], env: dict[str, str], workdir: Path, rng: random.Random):
        self.args, self.env, self.workdir, self.rng = args, env, workdir, rng

    def run(self, number: int, invocation: Invocation, timeout: float = 600) -> Outcome:
        timeline = self.workdir / f"timeline-{number}.txt"
        fired_dir = self.workdir / f"failpoints-{number}"
        fired_dir.mkdir(parents=True, exist_ok=True)
        points = [f"after_part_write@{f.hit}:kill" for f in invocation.faults if f.kind == "crash_after_part_write"]
        points += [f"before_part_write@{f.hit}:enospc" for f in invocation.faults if f.kind == "disk_full"]
        points += [f"after_part_write@{f.hit}:kill_run" for f in invocation.faults if f.kind == "kill_run_after_part_write"]
        env = dict(self.env, GENRUN_TIMELINE=str(timeline), GENRUN_FAILPOINTS=",".join(points), GENRUN_FAILPOINT_DIR=str(fired_dir))
        log_out, log_err = open(self.workdir / f"run-{number}.out", "w+"), open(self.workdir / f"run-{number}.err", "w+")
        started = time.time()
        process = subprocess.Popen(GENRUN + self.args, cwd=REPO, env=env, stdout=log_out, stderr=log_err, text=True, start_new_session=True)
        timed = [f for f in invocation.faults if f.kind in ("kill_run", "kill_shard_worker", "kill_replica", "concurrent_run")]
        injected: list[str] = []
        outcome_extra = {"concurrent_refused": 0, "concurrent_not_refused": 0, "concurrent_after_finish": 0}
        helpers: list[threading.Thread] = []
        try:
            while process.poll() is None:
                assert time.time() - started < timeout, f"invocation {number} did not finish in {timeout} s"
                events = timeline_events(timeline)
                for fault in list(timed):
                    seen = [e for e in events if e[0] == fault.trigger] if fault.trigger != "start" else [("start", process.pid, started)]
                    if not seen or time.time() < seen[0][2] + fault.delay:
                        continue
                    timed.remove(fault)
                    if self._land(fault, process, events, env, outcome_extra, helpers):
                        injected.append(fault.kind)
                time.sleep(0.1)
            for helper in helpers:
                helper.join(timeout=300)
        finally:
            kill_group(process)
        # Failpoints that fired left their marker.
        armed = {"after_part_write": "crash_after_part_write", "before_part_write": "disk_full"}
        if any(f.kind == "kill_run_after_part_write" for f in invocation.faults):
            armed["after_part_write"] = "kill_run_after_part_write"
        injected += [armed[name.split(".")[0]] for name in os.listdir(fired_dir)]
        log_out.seek(0), log_err.seek(0)
        outcome = Outcome(process.returncode, log_out.read(), log_err.read(), injected, **outcome_extra)
        log_out.close(), log_err.close()
        return outcome

    def _land(self, fault: Fault, process, events, env, extra, helpers) -> bool:
        if fault.kind == "kill_run":
            os.kill(process.pid, signal.SIGKILL)
            return True
        if fault.kind == "kill_shard_worker":
            pids = [pid for event, pid, _ in events if event == "shard_worker_ready" and _alive(pid)]
            return self._kill_one(pids)
        if fault.kind == "kill_replica":
            pids = [pid for event, pid, _ in events if event == "replica_ready" and _alive(pid)]
            return self._kill_one(pids)
        if fault.kind == "concurrent_run":
            helpers.append(threading.Thread(target=self._concurrent, args=(env, extra), daemon=True))
            helpers[-1].start()
            return True
        raise AssertionError(fault.kind)

    def _kill_one(self, pids: list[int]) -> bool:
        if not pids:
            return False
        os.kill(self.rng.choice(pids), signal.SIGKILL)
        return True

    def _concurrent(self, env, extra) -> None:
        second = subprocess.run(GENRUN + self.args, cwd=REPO, env=dict(env, GENRUN_FAILPOINTS="", GENRUN_TIMELINE=""), capture_output=True, text=True, timeout=600)
        if second.returncode == 2 and "is in use by another genrun run" in second.stderr:
            extra["concurrent_refused"] += 1
        elif second.returncode == 0 and self._ran_after_the_first(second):
            # The first run had released the folder before the second checked: a plain rerun.
            extra["concurrent_after_finish"] += 1
        else:
            extra["concurrent_not_refused"] += 1
            (self.workdir / "concurrent-not-refused.log").write_text(second.stdout + second.stderr)

    def _ran_after_the_first(self, second) -> bool:
        """Whether the second run took the lease only after the first released it (the lease
        folder keeps the previous holder's record, with its release time)."""
        out = Path(next(a.split("=", 1)[1] for a in self.args if a.startswith("trainer.default_local_dir=")))
        records = sorted((json.loads(p.read_text()) for p in (out / "lease").glob("*.json")), key=lambda r: r["generation"])
        if len(records) < 2:
            return False
        previous, latest = records[-2], records[-1]
        return bool(previous.get("released_at")) and latest["acquired"] >= previous["released_at"]


def damage_a_part(run_dir: Path, how: str, rng: random.Random) -> str | None:
    """Damage one committed part (listed by a checkpoint); returns its path, or None if none."""
    listed = []
    for checkpoint in sorted(run_dir.glob("shards/*/checkpoint.json")):
        listed += [checkpoint.parent / part["name"] for part in json.loads(checkpoint.read_text())["parts"]]
    if not listed:
        return None
    path = rng.choice(listed)
    data = bytearray(path.read_bytes())
    if how == "truncate_part":
        path.write_bytes(bytes(data[: len(data) // 3]))
    elif how == "flip_part_byte":
        data[rng.randrange(len(data))] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    return str(path.relative_to(run_dir))


@dataclass
class Tally:
    schedules: int = 0
    invocations: int = 0
    faults: Counter = field(default_factory=Counter)
    expected: int = 0
    lost: int = 0
    duplicated: int = 0
    bad_inputs_tried: int = 0
    bad_inputs_refused: int = 0
    concurrent_refused: int = 0
    concurrent_after_finish: int = 0

    def line(self) -> str:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.faults.items())) or "none"
        return (
            f"chaos: {self.schedules} schedules, {self.invocations} genrun invocations; faults injected: {kinds}; "
            f"trajectories expected {self.expected}, lost {self.lost}, duplicated {self.duplicated}; "
            f"second runs on a busy folder refused {self.concurrent_refused} (started after the first ended: {self.concurrent_after_finish}); "
            f"bad inputs tried {self.bad_inputs_tried}, refused {self.bad_inputs_refused}"
        )
