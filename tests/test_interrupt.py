"""What a person at a terminal sees: a real `genrun` (instant engine with a delay, two shards)
in a pseudo-terminal shows one live progress line; a Ctrl-C (the terminal's ^C, sent to the
whole foreground process group) stops it with exit 130 and a message saying how much is
committed, leaves the lease released and the flow run Cancelled; a second Ctrl-C quits at once,
and the same command then takes the folder over and finishes with exact counts and a merged
result equal to an uninterrupted run's, its default output (not a terminal) holding none of the
libraries' noise."""

import contextlib
import json
import os
import pty
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import torch
from verl.protocol import DataProto

from generation_core.outputs.padding import RUN_DEPENDENT_KEYS
from generation_core.processes import command_line, descendants, kill_and_wait, process_table
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import newest_lease
from tests.conftest import GENRUN, REPO, chat_rows, run_genrun, write_parquet
from tests.run_folder_helpers import committed_keys

pytestmark = [pytest.mark.slow]

PROMPTS = 120
N = 2
TOTAL = PROMPTS * N
NOISE = (
    "dataset len",
    "Using dataset class",
    "docs.prefect.io",
    "dedicated Prefect server",
    "Starting temporary server",
    "Finished in state",
    "Beginning flow run",
    "LLMServerManager",
    "accelerator",
    "RAY_ACCEL_ENV_VAR",
    "(run_shard pid=",
    "worker.py:",
    "FutureWarning",
    "UserWarning",
    "DeprecationWarning",
    "Traceback",
)


def _args(prompts, out):
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        # Requests take a while, so the run is still generating when the Ctrl-C comes.
        "actor_rollout_ref.rollout.engine_kwargs.instant.delay_seconds=0.25",
        f"actor_rollout_ref.rollout.n={N}",
        "generation.num_shards=2",
        "generation.max_inflight=2",
        "generation.first_part_max_seconds=0.5",
        "generation.part_max_seconds=1",
        "generation.progress_seconds=5",
    ]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("prompts") / "prompts.parquet", chat_rows(PROMPTS))


@pytest.fixture(scope="module")
def uninterrupted(prompts, tmp_path_factory, ray_local):
    """The merged result of the same run done to the end undisturbed (in this process: the
    flow's shards give the same records as the in-process dispatcher, test_flow checks that)."""
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    # Without the delay and with more requests in flight: neither changes what is generated.
    args = [a for a in _args(prompts, out) if "delay_seconds" not in a and "max_inflight" not in a]
    run_in_process(preflight([*args, "generation.max_inflight=64", "generation.show_progress=false"]))
    return DataProto.load_from_disk(str(out / "trajectories.pkl"))


class Terminal:
    """`genrun` in a pseudo-terminal: its session leader, with the terminal as its controlling
    one, so ^C written to the terminal reaches its whole foreground process group."""

    def __init__(self, args, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become genrun
            os.chdir(REPO)
            os.execve(GENRUN[0], [*GENRUN, *args], env)
        self.output = bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.returncode = None

    def _read(self):
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.output.extend(chunk)

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def ctrl_c(self):
        os.write(self.fd, b"\x03")

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            assert time.monotonic() < deadline, f"genrun did not exit within {timeout} s:\n{self.text()[-3000:]}"
            time.sleep(0.1)
        self.reader.join(timeout=10)
        return self.returncode

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.returncode is None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        os.close(self.fd)


def _left_behind(session: int, settle: float = 30.0) -> list[str]:
    """Processes still in genrun's session (Ray, the Prefect server) once they had `settle`
    seconds to go."""
    deadline = time.monotonic() + settle
    while True:
        listing = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
        left = [
            line.strip()
            for line in listing.splitlines()
            if line.split()[1] == str(session) and line.split()[0] != str(session)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _terminal_env(prefect_home):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "GENRUN_LOG_LEVEL")}
    env.update(PREFECT_HOME=str(prefect_home), TERM="xterm", PYTHONPATH=str(REPO))
    return env


def _wait_for_a_commit(terminal, out):
    deadline = time.monotonic() + 400
    while not (out / "shards").exists() or not committed_keys(out):
        assert terminal.poll() is None, f"genrun exited early:\n{terminal.text()[-3000:]}"
        assert time.monotonic() < deadline, f"nothing committed in time:\n{terminal.text()[-3000:]}"
        time.sleep(0.2)


def _flow_run_states(prefect_home) -> list[str]:
    """The flow runs' final states, read from the temporary server's database (it is gone)."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return [row[0] for row in db.execute("SELECT state_type FROM flow_run ORDER BY created")]


def _progress_artifacts(prefect_home) -> list[tuple[float, str]]:
    """(percent, description) of the flow runs' progress artifacts, oldest first."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        rows = db.execute("SELECT data, description FROM artifact WHERE type = 'progress' ORDER BY created").fetchall()
    # The JSON column comes back as a number or as its text, depending on SQLite's affinity.
    return [(float(json.loads(data) if isinstance(data, str) else data), description) for data, description in rows]


def _same_dataproto(actual: DataProto, expected: DataProto):
    assert sorted(actual.batch.keys()) == sorted(expected.batch.keys())
    for key in expected.batch.keys():
        assert torch.equal(actual.batch[key], expected.batch[key]), key
    for key in expected.non_tensor_batch:
        if key not in RUN_DEPENDENT_KEYS:
            assert actual.non_tensor_batch[key].tolist() == expected.non_tensor_batch[key].tolist(), key


def _stopped_cleanly(text: str, out, stopped_pattern: str) -> list:
    """What a first Ctrl-C leaves, whichever path ran: the stop said and counted (the count is
    what is committed, some but not all), no traceback, the lease released, no merge. Returns
    the committed sample keys."""
    assert "genrun: stopping:" in text
    stopped = re.search(stopped_pattern, text)
    assert stopped, text[-2000:]
    committed = committed_keys(out)
    assert int(stopped.group(1)) == len(committed) > 0
    assert len(committed) < TOTAL, "the Ctrl-C came after the run had finished: nothing was tested"
    assert "Traceback" not in text, text[-3000:]
    lease = newest_lease(StorageFolder(str(out)))
    assert lease is not None and lease.released, lease
    assert not (out / "trajectories.pkl").exists()
    return committed


@contextlib.contextmanager
def _ctrl_c_after_a_commit(prompts, tmp_path):
    """`genrun` in a terminal, sent a Ctrl-C once it has committed a part; killed on the way out
    whatever the test found."""
    out = tmp_path / "run"
    prefect_home = tmp_path / "prefect-home"
    prefect_home.mkdir()
    terminal = Terminal(_args(prompts, out), _terminal_env(prefect_home))
    try:
        _wait_for_a_commit(terminal, out)
        terminal.ctrl_c()
        yield terminal, out, prefect_home
    finally:
        terminal.kill()


def _resume_to_the_end(prompts, out, prefect_home, uninterrupted) -> subprocess.CompletedProcess:
    """The same command again: it finishes with every trajectory once, merged equal to the
    uninterrupted run's result."""
    resumed = run_genrun(_args(prompts, out), env={"PREFECT_HOME": str(prefect_home)}, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    keys = committed_keys(out)
    assert len(keys) == len(set(keys)) == TOTAL
    _same_dataproto(DataProto.load_from_disk(str(out / "trajectories.pkl")), uninterrupted)
    return resumed


@pytest.mark.timeout(900)
def test_ctrl_c_in_a_terminal_stops_cleanly_committing_what_finished(prompts, tmp_path):
    with _ctrl_c_after_a_commit(prompts, tmp_path) as (terminal, out, prefect_home):
        pressed = time.monotonic()
        # Generous: a slow shared machine. The design's bound is 30 s.
        assert terminal.wait(timeout=60) == 130
        print(f"exit 130 {time.monotonic() - pressed:.1f} s after the Ctrl-C")
        # Ray and the temporary Prefect server were stopped, not left running.
        assert _left_behind(terminal.pid) == []
    text = terminal.text()
    print(text[-3000:])
    # The live display: one line redrawn in place, with the counts and an ETA.
    assert re.search(r"\r\x1b\[Ktrajectories \d+/240 \(", text), text[-2000:]
    committed = _stopped_cleanly(
        text, out, r"genrun: stopped: (\d+) of 240 trajectories committed in .*; run the same command again to resume"
    )
    assert _flow_run_states(prefect_home) == ["CANCELLED"]
    # The flow run's progress artifact has the terminal's numbers, in trajectories.
    ((percent, description),) = _progress_artifacts(prefect_home)
    assert description.startswith(f"trajectories {len(committed)}/240 (") and percent == pytest.approx(
        100 * len(committed) / 240, abs=0.01
    )
    # Resuming what a stop leaves (committed parts, the lease released) is part of resuming what
    # a quit at once leaves (the test below; CI time: one resume for both).


# Extended: make test holds a quick exit at once (test_a_ctrl_c_while_replicas_boot_or_during_the_merge_exits_at_once_and_the_folder_resumes), the takeover after a kill (tests/test_crash_resume.py) and a Ctrl-C run resumed exactly (test_a_ctrl_c_stops_an_in_process_run_cleanly_with_progress_shown_and_the_run_resumes_exactly).
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_a_second_ctrl_c_quits_at_once_and_the_same_command_takes_over_and_resumes_exactly(
    prompts, uninterrupted, tmp_path
):
    with _ctrl_c_after_a_commit(prompts, tmp_path) as (terminal, out, prefect_home):
        deadline = time.monotonic() + 30
        while "genrun: stopping:" not in terminal.text():
            assert time.monotonic() < deadline, terminal.text()[-2000:]
            time.sleep(0.05)
        terminal.ctrl_c()
        pressed = time.monotonic()
        # At once: no waiting for shards or servers (generous for a loaded machine).
        assert terminal.wait(timeout=20) == 130
        print(f"exit 130 {time.monotonic() - pressed:.1f} s after the second Ctrl-C")
        # The Prefect server is killed; Ray's processes die with the process that started them.
        assert _left_behind(terminal.pid) == []
    text = terminal.text()
    assert "genrun: stopped at once; committed trajectories are kept, run the same command again to resume" in text, (
        text[-2000:]
    )
    committed = committed_keys(out)
    assert len(committed) == len(set(committed)) < TOTAL

    # The lease it left behind belongs to a process that is gone: the next run takes it over and
    # resumes exactly. This is make test's run killed at once (the state kill -9 leaves: lease
    # held, flow run left Running, shard workers cut off mid-part); the chaos schedules, in
    # make test-all, kill -9 at random moments.
    lease = newest_lease(StorageFolder(str(out)))
    assert lease is not None and lease.state(time.time()) in ("released", "owner gone"), lease
    # The same command, to the end, as `make demo` runs it (output not a terminal): exactly what
    # was missing is generated, and the output is the few lines a person needs.
    resumed = _resume_to_the_end(prompts, out, prefect_home, uninterrupted)
    assert f"trajectories:  {TOTAL} ({TOTAL - len(committed)} generated by this invocation)" in resumed.stdout, (
        resumed.stdout[-2000:]
    )
    # The quit run's flow run is left Running (nothing could report its end); the resumed one completes.
    states = _flow_run_states(prefect_home)
    assert len(states) == 2 and states[-1] == "COMPLETED", states
    _assert_quiet_default_output(resumed)
    percent, description = _progress_artifacts(prefect_home)[-1]
    assert percent == 100.0 and description.startswith(f"trajectories {TOTAL}/{TOTAL} (100.0%)"), description


def _assert_quiet_default_output(result: subprocess.CompletedProcess) -> None:
    """None of the libraries' noise: what runs where, progress (plain lines), the summary."""
    output = result.stdout + result.stderr
    print(output)
    assert [noise for noise in NOISE if noise in output] == []
    assert re.search(
        r"running on: Prefect API http://127\.0\.0\.1:\d+/api \(a temporary server\); Ray: Started a local Ray instance",
        result.stderr,
    )
    assert "inference: 1 instant replica(s)" in result.stderr
    assert f"trajectories {TOTAL}/{TOTAL} (100.0%)" in result.stderr
    assert "\r" not in output and "\x1b[" not in output
    # Progress lines: the start (the first line, then one every 30 s), the replicas starting, the trajectories.
    progress = (
        r"\d\d:\d\d:\d\d (trajectories \d+/|starting: checking the inputs|starting \d+ instant replica\(s\) on the CPU)"
    )
    others = [line for line in result.stderr.splitlines() if not re.match(progress, line)]
    assert len(others) <= 4, result.stderr


# ---- stages with nothing to commit: the first Ctrl-C ends them at once ----------------------
# One `genrun` (instant engine, a few prompts) per stage, held there by what the stage waits for
# (a planted lease) or by a failpoint; SIGINT goes to genrun itself (its helpers have SIGINT
# blocked, as when a terminal sends it to the whole group).

STAGE_PROMPTS = 4


def _stage_args(prompts, out):
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "actor_rollout_ref.rollout.n=1",
        "generation.show_progress=false",
    ]


@pytest.fixture(scope="module")
def few_prompts(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("few") / "prompts.parquet", chat_rows(STAGE_PROMPTS))


class Stage:
    """`genrun` as a subprocess in a session of its own, stderr in a file the test reads."""

    def __init__(self, args, tmp_path, env=None):
        self.stderr_path = tmp_path / "stderr.txt"
        full_env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "GENRUN_LOG_LEVEL")}
        full_env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(REPO), **(env or {}))
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                [*GENRUN, *args],
                cwd=REPO,
                env=full_env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_until(self, reached, what: str, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not reached():
            assert self.process.poll() is None, f"genrun exited before {what}:\n{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"genrun did not reach {what} in time:\n{self.stderr()[-3000:]}"
            time.sleep(0.2)

    def interrupt(self, timeout: float = 60) -> int:
        """SIGINT to genrun; its exit code (the test fails if it does not exit within `timeout`)."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"genrun did not exit within {timeout} s of a Ctrl-C:\n{self.stderr()[-3000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.mark.timeout(600)
def test_a_ctrl_c_while_waiting_for_a_dying_lease_exits_at_once_leaving_the_folder_as_it_was(few_prompts, tmp_path):
    out = tmp_path / "run"
    folder = _plant_dying_lease(out)
    stage = Stage(_stage_args(few_prompts, out), tmp_path)
    try:
        stage.wait_until(lambda: "waiting for its lease to expire" in stage.stderr(), "the lease wait")
        assert stage.interrupt() == 130
    finally:
        stage.kill()
    text = stage.stderr()
    assert (
        "genrun: stopped: 0 of 4 trajectories committed in" in text and "run the same command again to resume" in text
    ), text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    # Nothing was taken or written: the planted lease is still the newest, as it was.
    assert newest_lease(folder).owner == "x"
    assert not (out / "shards").exists()


@pytest.mark.timeout(600)
# The merge's Ctrl-C (an interruptible stage as the boot is) runs in make test-all (CI's budget).
@pytest.mark.parametrize("stage_name", ["boot_pool", pytest.param("merge", marks=pytest.mark.extended)])
def test_a_ctrl_c_while_replicas_boot_or_during_the_merge_exits_at_once_and_the_folder_resumes(
    few_prompts, tmp_path, stage_name
):
    """Held by a failpoint at the start of the replicas' boot (minutes for SGLang) or of the merge
    (every shard committed)."""
    out = tmp_path / "run"
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    stage = Stage(
        _stage_args(few_prompts, out),
        tmp_path,
        env={"GENRUN_FAILPOINTS": f"{stage_name}@1:hold", "GENRUN_FAILPOINT_DIR": str(failpoints)},
    )
    try:
        stage.wait_until((failpoints / f"{stage_name}.fired").exists, stage_name)
        assert stage.interrupt() == 130
    finally:
        stage.kill()
    text = stage.stderr()
    committed = STAGE_PROMPTS if stage_name == "merge" else 0
    assert f"genrun: stopped: {committed} of {STAGE_PROMPTS} trajectories committed in" in text, text[-2000:]
    assert "run the same command again to resume" in text and "Traceback" not in text, text[-3000:]
    # What was committed, once; the lease released: the same command goes on from there.
    keys = committed_keys(out) if (out / "shards").exists() else []
    assert len(keys) == len(set(keys)) == committed
    assert newest_lease(StorageFolder(str(out))).released
    assert not (out / "trajectories.pkl").exists()


def _plant_dying_lease(out) -> StorageFolder:
    """The lease of a run on another host that missed its heartbeats: a genrun waits out its hour."""
    folder = StorageFolder(str(out))
    now = time.time()
    planted = {
        "generation": 1,
        "owner": "x",
        "host": "another-host",
        "pid": 1,
        "seconds": 3600,
        "acquired": now - 2000,
        "renewed": now - 2000,
        "released": False,
    }
    folder.put_atomic("lease/00000001.json", json.dumps(planted).encode())
    return folder


# ---- kill -9: nothing genrun started outlives it --------------------------------------------
# A genrun is killed at each of these moments, as soon as a look at /proc (every 50 ms) sees it
# there: its temporary Prefect server just started, its raylet just starting Ray's agents (the
# moment of audit #9), and generating (a shard worker running, requests in flight). Each gets the
# processes below genrun now (pid -> (parent pid, command line)) and the run's timeline file.


def _raylet_has_children(below: dict[int, tuple[int, str]]) -> bool:
    raylets = {pid for pid, (_, args) in below.items() if "ray/raylet/raylet" in args}
    return any(parent in raylets for parent, _ in below.values())


KILL_MOMENTS = {
    "Prefect server starting": lambda below, timeline: any("uvicorn" in args for _, args in below.values()),
    "Ray's agents starting": lambda below, timeline: _raylet_has_children(below),
    "generating": lambda below, timeline: timeline.exists() and "shard_worker_ready" in timeline.read_text(),
}
# Generous for a loaded machine: the promise is 5 s; the agents that outlived genrun ran ~70 s.
GONE_DEADLINE_SECONDS = 20


def _look_below(pid: int, noted: dict[tuple[int, int], str]) -> dict[int, tuple[int, str]]:
    """The processes below `pid` now, pid -> (parent pid, command line); each is added to `noted`,
    (pid, start time) -> command line."""
    table = process_table()
    below = {child: (table[child].ppid, _args_of(child)) for child in descendants(table, [pid])}
    for child, (_, args) in below.items():
        # A process's command line changes when it execs (Ray's agents set a title): keep the latest.
        noted[(child, table[child].started)] = args or noted.get((child, table[child].started), "")
    return below


def _args_of(pid: int) -> str:
    return command_line(pid).replace(b"\0", b" ").decode(errors="replace").strip()


def _kill_9_when(stage: Stage, moment: str, timeline) -> dict[tuple[int, int], str]:
    """kill -9 genrun as soon as it reaches `moment`; what ran below it until then."""
    noted: dict[tuple[int, int], str] = {}
    reached = KILL_MOMENTS[moment]
    deadline = time.monotonic() + 400
    while not reached(_look_below(stage.process.pid, noted), timeline):
        assert stage.process.poll() is None, f"genrun exited before {moment}:\n{stage.stderr()[-3000:]}"
        assert time.monotonic() < deadline, f"genrun did not reach {moment} in time:\n{stage.stderr()[-3000:]}"
        time.sleep(0.05)
    stage.process.kill()
    stage.process.wait()
    return noted


def _still_running(noted: dict[tuple[int, int], str], session: int) -> list[str]:
    """Those of `noted` still running, and any other process of genrun's session."""
    table = process_table()
    left = [f"{pid} {args}" for (pid, started), args in noted.items() if pid in table and table[pid].started == started]
    for pid in table:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getsid(pid) == session and all(pid != noted_pid for noted_pid, _ in noted):
                left.append(f"{pid} (genrun's session) {_args_of(pid)}")
    return left


# "generating" (every process started long before, seen by the watchdog) runs in make test-all:
# the moments the audit found processes left behind at are the two starts (CI's time budget).
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "moment",
    [
        "Prefect server starting",
        "Ray's agents starting",
        pytest.param("generating", marks=pytest.mark.extended),
    ],
)
def test_a_genrun_killed_with_kill_9_leaves_no_prefect_server_or_ray_behind(few_prompts, tmp_path, moment):
    """Issue 43 item 7 / audit #9: a kill -9 just after Ray's raylet started its DashboardAgent and
    RuntimeEnvAgent left them running for about a minute: the watchdog noted genrun's processes
    once a second and missed those started after its last look (the agents, left to init when
    the raylet died with genrun). At a moment of KILL_MOMENTS a genrun is killed with kill -9: soon after,
    nothing it started runs, neither a process seen below it (its watchdog included) nor one in
    its session."""
    timeline = tmp_path / "timeline.txt"
    # Requests take a while, so the run is still generating when the kill comes.
    args = [
        *_stage_args(few_prompts, tmp_path / "run"),
        "generation.max_inflight=1",
        "actor_rollout_ref.rollout.engine_kwargs.instant.delay_seconds=5",
    ]
    stage = Stage(args, tmp_path, env={"GENRUN_TIMELINE": str(timeline)})
    noted: dict[tuple[int, int], str] = {}
    try:
        noted = _kill_9_when(stage, moment, timeline)
        killed = time.monotonic()
        while (left := _still_running(noted, stage.process.pid)) and time.monotonic() - killed < GONE_DEADLINE_SECONDS:
            time.sleep(0.2)
        print(
            f"{moment}: {len(noted)} processes below genrun; {len(left)} running {time.monotonic() - killed:.1f} s after the kill"
        )
        assert left == [], f"{moment}: running {GONE_DEADLINE_SECONDS} s after genrun's kill -9: {left}"
    finally:
        stage.kill()
        kill_and_wait({pid: started for pid, started in noted})


# ---- the in-process dispatcher: the same driver, the same Ctrl-C and progress ---------------

IN_PROCESS = """
import sys
from generation_core.console import setup_logging
from generation_core.driver.in_process import run_in_process
from generation_core.preflight.preflight import preflight

setup_logging()
try:
    run_in_process(preflight(sys.argv[1:]))
except KeyboardInterrupt as stopped:
    print(f"in-process: {stopped}", file=sys.stderr)
    sys.exit(130)
"""


# The driver under a Ctrl-C is the same as genrun's (test_ctrl_c_in_a_terminal_... in make test),
# run_in_process's handling of the signal is tests/test_stop_request.py's (issue 44: CI's budget).
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_a_ctrl_c_stops_an_in_process_run_cleanly_with_progress_shown_and_the_run_resumes_exactly(
    prompts, uninterrupted, tmp_path
):
    """`run_in_process` in a script of its own (no Prefect): its progress lines, and a Ctrl-C
    once a part is committed stops it as it stops `genrun` (the shard job commits what finished,
    the lease is released), raising a KeyboardInterrupt that says what is kept."""
    out = tmp_path / "run"
    stderr_path = tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("GENRUN_LOG_LEVEL",)}
    env.update(PYTHONPATH=str(REPO))
    args = [*_args(prompts, out), "generation.progress_seconds=1"]
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", IN_PROCESS, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        while not (out / "shards").exists() or not committed_keys(out):
            assert process.poll() is None, f"the run exited early:\n{stderr_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"nothing committed in time:\n{stderr_path.read_text()[-3000:]}"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(timeout=60) == 130, stderr_path.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not exit within 60 s of a Ctrl-C:\n{stderr_path.read_text()[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    text = stderr_path.read_text(errors="replace")
    print(text[-3000:])
    # The driver's progress lines, as `genrun` prints them when the output is not a terminal.
    assert re.search(r"\d\d:\d\d:\d\d trajectories \d+/240 \(", text), text[-2000:]
    _stopped_cleanly(
        text,
        out,
        r"in-process: stopped on request: (\d+) trajectories committed in .*; run the same command again to resume",
    )

    # The same call again (here, in this process) generates exactly what is missing.
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    summary = run_in_process(preflight([*_args(prompts, out), "generation.show_progress=false"]))
    assert summary["num_trajectories"] == TOTAL
    keys = committed_keys(out)
    assert len(keys) == len(set(keys)) == TOTAL
    _same_dataproto(DataProto.load_from_disk(str(out / "trajectories.pkl")), uninterrupted)
