"""Seeded random fault schedules over real `genrun` runs, and the invocation driver.

A schedule is a list of invocations of the same command on the same output folder. The first
ones are killed (-9) at a random moment or exactly after a part write; one runs with several
faults that the run must survive (shard worker killed, a replica killed, a crash between a part
write and its checkpoint, a full disk, a second run started on the same folder while the first
holds it); before any invocation but the first a committed part may be damaged; then the same
command is run until it succeeds (at most twice: a corruption of a finished shard that only the
merge can see costs one more run). Faults hit real processes by PID; the ones a timer cannot aim
at a window use failpoints (generation_core/instrumentation.py).

A fault counts only when it hit something: a kill lands on a live process that is doing the
work it is aimed at (a shard worker with its shard unfinished, a replica while shards run), a
second run overlaps the first, a failpoint fires, a damage finds a committed part. A timed fault
without a target is tried again until the run ends; a damage without one waits for the next
invocation. Whatever never found a target is reported in `Outcome.missed`, and the schedule fails.
"""

from __future__ import annotations

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
from tests.run_folder_helpers import checkpoint_dict

# Faults a run survives within one invocation, and where each one is aimed.
SURVIVABLE = ("kill_shard_worker", "kill_replica", "crash_after_part_write", "disk_full", "concurrent_run")
# Moments after which a kill -9 of the whole run may land ("start": anywhere from the beginning).
KILL_TRIGGERS = ("start", "ray_ready", "engine_ready", "part_written")
BETWEEN_RUNS = ("truncate_part", "flip_part_byte", "delete_part")
FAULT_KINDS = ("kill_run", "kill_run_after_part_write", *SURVIVABLE, *BETWEEN_RUNS)
"""Every kind of fault; the schedule `make test` runs holds each one (test_schedules.py)."""

# The concurrent run's window: while it starts and checks the folder, the first run holds
# samples whose index within their shard is GATE_FROM or more at a gate (tests/chaos/
# agent_loops.py), so the two overlap whatever the machine's speed. Set for the chaos runs'
# 12 prompts per shard: 4 prompts of each shard commit first.
GATE_FROM, GATE_PER_SHARD = 4, 12


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

    @property
    def must_survive(self) -> bool:
        return bool(self.faults) and all(f.kind in SURVIVABLE for f in self.faults)


def make_schedule(seed: int) -> list[Invocation]:
    rng = random.Random(seed)
    schedule = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        if rng.random() < 0.4:
            schedule.append(Invocation([Fault("kill_run_after_part_write", hit=rng.randint(1, 4))]))
        else:
            trigger = rng.choice(KILL_TRIGGERS)
            # From the start: within the first 20 s, which every run outlives (startup alone
            # takes longer); the other triggers spread kills over the generation.
            delay = rng.uniform(2.0, 20.0) if trigger == "start" else rng.uniform(0.0, 4.0)
            schedule.append(Invocation([Fault("kill_run", trigger, delay)]))
    faults = []
    for kind in rng.sample(SURVIVABLE, rng.randint(2, 5)):
        if kind == "crash_after_part_write":
            faults.append(Fault(kind, hit=rng.randint(1, 3)))
        elif kind == "disk_full":
            faults.append(Fault(kind, hit=rng.randint(1, 4)))
        elif kind == "concurrent_run":
            faults.append(Fault(kind, "engine_ready", rng.uniform(0.0, 2.0)))
        else:
            faults.append(Fault(kind, rng.choice(("engine_ready", "part_written")), rng.uniform(0.0, 3.0)))
    schedule.append(Invocation(faults))
    schedule.append(Invocation())
    for invocation in schedule[1:]:
        if rng.random() < 0.6:
            invocation.damage_before = rng.choice(BETWEEN_RUNS)
    return schedule


def fault_kinds(schedule: list[Invocation]) -> set[str]:
    return {f.kind for invocation in schedule for f in invocation.faults} | {
        i.damage_before for i in schedule if i.damage_before
    }


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    injected: list[str]
    missed: list[str] = field(default_factory=list)
    """Faults of this invocation that found no target (each says why)."""
    concurrent_refused: int = 0
    concurrent_not_refused: int = 0


@dataclass
class Event:
    name: str
    shard: int | None
    pid: int
    time: float


def timeline_events(path: Path) -> list[Event]:
    """Lines that processes of the run wrote (generation_core/instrumentation.py):
    `<event> [<shard id>] pid=<pid> <unix time>`."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        match = re.match(r"(\S+)(?: (\d+))? pid=(\d+) (\S+)$", line)
        if match:
            shard = None if match.group(2) is None else int(match.group(2))
            events.append(Event(match.group(1), shard, int(match.group(3)), float(match.group(4))))
    return events


def working_shard_workers(events: list[Event]) -> list[int]:
    """Live processes that started a shard and have not finished it."""
    done = {(e.shard, e.pid) for e in events if e.name == "shard_done"}
    return [e.pid for e in events if e.name == "shard_worker_ready" and (e.shard, e.pid) not in done and _alive(e.pid)]


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
        armed = {}
        for fault in invocation.faults:
            if fault.kind == "crash_after_part_write":
                armed[f"after_part_write@{fault.hit}:kill"] = fault.kind
            elif fault.kind == "disk_full":
                armed[f"before_part_write@{fault.hit}:enospc"] = fault.kind
            elif fault.kind == "kill_run_after_part_write":
                armed[f"after_part_write@{fault.hit}:kill_run"] = fault.kind
        env = dict(
            self.env,
            GENRUN_TIMELINE=str(timeline),
            GENRUN_FAILPOINTS=",".join(armed),
            GENRUN_FAILPOINT_DIR=str(fired_dir),
        )
        gate = self.workdir / f"gate-{number}"
        if any(f.kind == "concurrent_run" for f in invocation.faults):
            gate.write_text("")
            env.update(
                GENRUN_TEST_GATE=str(gate),
                GENRUN_TEST_GATE_FROM=str(GATE_FROM),
                GENRUN_TEST_GATE_PER_SHARD=str(GATE_PER_SHARD),
            )
        log_out, log_err = (
            open(self.workdir / f"run-{number}.out", "w+"),
            open(self.workdir / f"run-{number}.err", "w+"),
        )
        started = time.time()
        process = subprocess.Popen(
            GENRUN + self.args, cwd=REPO, env=env, stdout=log_out, stderr=log_err, text=True, start_new_session=True
        )
        timed = [
            f
            for f in invocation.faults
            if f.kind in ("kill_run", "kill_shard_worker", "kill_replica", "concurrent_run")
        ]
        injected: list[str] = []
        extra = {"concurrent_refused": 0, "concurrent_not_refused": 0, "missed": []}
        helpers: list[threading.Thread] = []
        try:
            while process.poll() is None:
                assert time.time() - started < timeout, f"invocation {number} did not finish in {timeout} s"
                events = timeline_events(timeline)
                for fault in list(timed):
                    seen = (
                        [e.time for e in events if e.name == fault.trigger] if fault.trigger != "start" else [started]
                    )
                    if not seen or time.time() < seen[0] + fault.delay:
                        continue
                    # No target yet (no shard worker up, the one there just died): next poll.
                    if self._land(fault, process, events, env, gate, extra, injected, helpers):
                        timed.remove(fault)
                time.sleep(0.1)
            for helper in helpers:
                helper.join(timeout=600)
        finally:
            gate.unlink(missing_ok=True)
            kill_group(process)
        for fault in timed:
            extra["missed"].append(
                f"{fault.kind} (after {fault.trigger} + {fault.delay:.1f} s): no target while the run lived"
            )
        # Failpoints that fired left their marker.
        fired = {name.split(".")[0] for name in os.listdir(fired_dir)}
        for point, kind in armed.items():
            if point.split("@")[0] in fired:
                injected.append(kind)
            else:
                extra["missed"].append(f"{kind} ({point}): the failpoint never fired")
        log_out.seek(0), log_err.seek(0)
        outcome = Outcome(process.returncode, log_out.read(), log_err.read(), injected, **extra)
        log_out.close(), log_err.close()
        return outcome

    def _land(self, fault: Fault, process, events, env, gate, extra, injected, helpers) -> bool:
        """Land `fault` if it has a target now; False to try again at the next poll."""
        if fault.kind == "kill_run":
            os.kill(process.pid, signal.SIGKILL)
            injected.append(fault.kind)
            return True
        if fault.kind == "kill_shard_worker":
            return self._kill_one(working_shard_workers(events), fault, injected)
        if fault.kind == "kill_replica":
            # A replica is a target while shards still send it requests.
            replicas = (
                [e.pid for e in events if e.name == "replica_ready" and _alive(e.pid)]
                if working_shard_workers(events)
                else []
            )
            return self._kill_one(replicas, fault, injected)
        if fault.kind == "concurrent_run":
            helpers.append(
                threading.Thread(target=self._concurrent, args=(env, process, gate, extra, injected), daemon=True)
            )
            helpers[-1].start()
            return True
        raise AssertionError(fault.kind)

    def _kill_one(self, pids: list[int], fault: Fault, injected: list[str]) -> bool:
        if not pids:
            return False
        os.kill(self.rng.choice(sorted(set(pids))), signal.SIGKILL)
        injected.append(fault.kind)
        return True

    def _concurrent(self, env, first: subprocess.Popen, gate: Path, extra, injected) -> None:
        """A second `genrun` on the same folder while the first holds it (held at the gate until
        the second has answered): it must be refused."""
        try:
            second = subprocess.run(
                GENRUN + self.args,
                cwd=REPO,
                env=dict(env, GENRUN_FAILPOINTS="", GENRUN_TIMELINE=""),
                capture_output=True,
                text=True,
                timeout=600,
            )
            overlapped = first.poll() is None
        finally:
            gate.unlink(missing_ok=True)
        if not overlapped:
            extra["missed"].append(
                f"concurrent_run: the first run had ended (exit {first.returncode}) before the second one answered"
            )
            (self.workdir / "concurrent-no-overlap.log").write_text(second.stdout + second.stderr)
            return
        injected.append("concurrent_run")
        if second.returncode == 2 and "is in use by another genrun run" in second.stderr:
            extra["concurrent_refused"] += 1
        else:
            extra["concurrent_not_refused"] += 1
            (self.workdir / "concurrent-not-refused.log").write_text(second.stdout + second.stderr)


def damage_a_part(run_dir: Path, how: str, rng: random.Random, spare: set[str] = frozenset()) -> str | None:
    """Damage one committed part (listed by a commit record, present, not in `spare`); returns its
    path relative to the run folder, or None when there is none."""
    listed = []
    for shard in sorted(path.name for path in run_dir.glob("shards/*")):
        listed += [run_dir / "shards" / shard / part["name"] for part in checkpoint_dict(run_dir, shard)["parts"]]
    listed = [path for path in listed if path.exists() and str(path.relative_to(run_dir)) not in spare]
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
    missed: int = 0
    expected: int = 0
    lost: int = 0
    duplicated: int = 0
    bad_inputs_tried: int = 0
    bad_inputs_refused: int = 0
    concurrent_refused: int = 0

    def line(self) -> str:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.faults.items())) or "none"
        return (
            f"chaos: {self.schedules} schedules, {self.invocations} genrun invocations; faults injected: {kinds}; "
            f"faults that found no target: {self.missed}; "
            f"trajectories expected {self.expected}, lost {self.lost}, duplicated {self.duplicated}; "
            f"second runs on a busy folder refused {self.concurrent_refused}; "
            f"bad inputs tried {self.bad_inputs_tried}, refused {self.bad_inputs_refused}"
        )
