"""Fault 7: infrastructure restarts around a run, with real processes killed by PID.

(a) The Prefect server is killed (-9) while a run is generating and started again on the same
    port and database: the run finishes or fails with a clear message within a bound, and the
    same command run again finishes with every trajectory exactly once.
(b) A separately started Ray head (`ray start --head`) serves a plain run end to end; a second
    run is killed mid-way, the head is killed and started again on the same port, and the same
    command finishes the run exactly once.

Runs are held mid-generation by a gated agent loop (tests/chaos/agent_loops.py): the first part
of each shard commits, the other samples wait until the test removes the gate file. The
`instant` engine keeps generation itself out of the time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from verl.protocol import DataProto

from tests.conftest import GENRUN, REPO, chat_rows, free_port, kill_group, run_genrun, write_parquet
from tests.run_folder_helpers import committed_keys, has_committed_part

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(900)]

BIN = Path(sys.executable).parent
AGENT_LOOPS = REPO / "tests" / "chaos" / "agent_loops.yaml"
PROMPTS = 8
SHARDS = 2
PER_SHARD = PROMPTS // SHARDS
# Each shard commits its first 2 samples (one part), the rest wait at the gate.
GATE_FROM = 2
# A run whose Prefect server went away must end (finish or fail) within this many seconds of
# the server coming back: Prefect's client retries (about a minute of backoff) plus shutdown.
END_BOUND = 150


def _args(prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "actor_rollout_ref.rollout.engine_kwargs.instant.response_tokens=8",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENT_LOOPS}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=gated_agent",
        f"generation.num_shards={SHARDS}",
        "generation.save_batch_size=2",
        "generation.retry_delay_seconds=0",
        "generation.show_progress=false",
        *extra,
    ]


def _gate_env(gate: Path) -> dict[str, str]:
    return {
        "GENRUN_TEST_GATE": str(gate),
        "GENRUN_TEST_GATE_FROM": str(GATE_FROM),
        "GENRUN_TEST_GATE_PER_SHARD": str(PER_SHARD),
        "PYTHONPATH": str(REPO),
    }


def _shards(out: Path) -> list[str]:
    return [f"shard-{s:05d}" for s in range(SHARDS)]


def _assert_exactly_once(out: Path) -> None:
    completed = committed_keys(out)
    assert sorted(completed) == sorted(f"{i}:0" for i in range(PROMPTS)), completed
    data = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert data.non_tensor_batch["index"].tolist() == list(range(PROMPTS))


def _start_genrun(args: list[str], env: dict, log_path: Path) -> tuple[subprocess.Popen, object]:
    log = open(log_path, "w")
    process = subprocess.Popen(
        GENRUN + args,
        cwd=REPO,
        env=dict(os.environ, **env),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return process, log


def _wait_generating(process: subprocess.Popen, out: Path, log_path: Path, timeout: float = 240) -> None:
    """Until every shard has committed its first part (the rest wait at the gate)."""
    deadline = time.monotonic() + timeout
    while not all(has_committed_part(out, shard) for shard in _shards(out)):
        assert process.poll() is None, f"genrun exited early:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no part committed in time:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.1)


# --- (a) Prefect server ---------------------------------------------------------------------


class RestartablePrefectServer:
    """`prefect server start` on a fixed port with its own PREFECT_HOME (SQLite database), so a
    killed server comes back at the same URL with the same flow runs."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        self.env.update(
            PREFECT_HOME=str(home),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_UI_ENABLED="false",
            PYTHONPATH=str(REPO),
        )
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 120) -> float:
        started = time.monotonic()
        self.starts += 1
        log_path = self.home / f"server-{self.starts}.log"
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None and time.monotonic() - started < timeout, log_path.read_text()[-3000:]
            time.sleep(0.2)

    def kill9(self) -> None:
        """kill -9 of the server's process group, as a crash (no shutdown handlers)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            kill_group(self.process)

    def api(self, method: str, path: str, **kwargs):
        response = httpx.request(method, f"{self.url}{path}", timeout=30, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None


@pytest.fixture(scope="module")
def restartable_prefect(tmp_path_factory):
    """One server for the module (each start costs ~15 s here); (a) restarts it, (b) uses it."""
    server = RestartablePrefectServer(tmp_path_factory.mktemp("prefect-home"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


# In make test-all (CI time budget); the Ray head restart below runs in make test.
@pytest.mark.extended
def test_prefect_server_restarted_during_a_run(restartable_prefect, tmp_path):
    server = restartable_prefect
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(PROMPTS))
    out, gate = tmp_path / "run", tmp_path / "gate"
    gate.write_text("")
    env = dict(_gate_env(gate), PREFECT_API_URL=server.url)
    log_path = tmp_path / "first.log"
    process, log = _start_genrun(_args(prompts, out), env, log_path)
    try:
        _wait_generating(process, out, log_path)
        server.kill9()
        killed_at = time.monotonic()
        # The shards finish while the server is down: their final states and the flow's
        # progress updates meet a refused connection.
        gate.unlink()
        print(f"prefect server restarted in {server.start():.1f} s")
        try:
            process.wait(timeout=END_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"genrun did not end within {END_BOUND} s of the Prefect server's restart:\n{log_path.read_text()[-4000:]}"
            )
        first = log_path.read_text()
        print(
            f"first run: exit {process.returncode} {time.monotonic() - killed_at:.1f} s after the kill\n{first[-2500:]}"
        )
    finally:
        kill_group(process)
        log.close()
    flow_runs = server.api("POST", "/flow_runs/filter", json={})
    print("flow runs after the restart:", [(r["name"], r["state"]["type"], r["state"]["name"]) for r in flow_runs])
    if process.returncode != 0:
        assert "error" in first.lower()

    again = run_genrun(_args(prompts, out), env=env, timeout=300)
    print(f"second run: exit {again.returncode}\n{again.stdout[-1500:]}\n{again.stderr[-1500:]}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"trajectories:  {PROMPTS} " in again.stdout
    _assert_exactly_once(out)


# --- (b) Ray head ----------------------------------------------------------------------------


class RayHead:
    """`ray start --head --block` in its own session on a fixed port and temp dir. Stopped by
    the PIDs of its process tree, never by `ray stop --force` (that stops every Ray of this
    user on the machine, other runs' included)."""

    def __init__(self, temp_dir: Path, log_dir: Path, env: dict):
        self.temp_dir, self.log_dir, self.port = temp_dir, log_dir, free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = dict(os.environ, **env)
        self.env.pop("RAY_ADDRESS", None)
        self.env["RAY_AUTH_MODE"] = "disabled"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 120) -> float:
        started = time.monotonic()
        self.starts += 1
        log_path = self.log_dir / f"ray-head-{self.starts}.log"
        command = [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.port}",
            "--include-dashboard=false",
            "--num-cpus=2",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",
            "--object-store-memory=134217728",
        ]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        while "Ray runtime started" not in log_path.read_text():
            assert self.process.poll() is None and time.monotonic() - started < timeout, log_path.read_text()[-3000:]
            time.sleep(0.2)
        return time.monotonic() - started

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill9(self) -> None:
        """kill -9 of the head and every process under it (GCS, raylet, workers), as a crash."""
        tree = self._tree()
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        psutil.wait_procs(tree, timeout=30)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            self.kill9()


@pytest.fixture
def ray_head(tmp_path):
    # Unix socket paths under the temp dir must stay short (108 bytes).
    temp_dir = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))
    gate = tmp_path / "gate"
    head = RayHead(temp_dir, tmp_path, _gate_env(gate))
    head.gate = gate
    try:
        yield head
    finally:
        head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


# CI time: make test covers a separately started Ray cluster (test_multinode) and a run killed
# with -9 then resumed exactly (the chaos schedule's kill_run); this one adds the head's restart.
@pytest.mark.extended
def test_ray_head_restarted_between_runs(ray_head, restartable_prefect, tmp_path):
    server = restartable_prefect
    print(f"ray head up in {ray_head.start():.1f} s")
    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(PROMPTS))
    env = dict(_gate_env(ray_head.gate), PREFECT_API_URL=server.url)
    on_cluster = f"ray_kwargs.ray_init.address={ray_head.address}"

    # A run killed (-9, its whole process group) with a part of every shard committed.
    out = tmp_path / "run"
    ray_head.gate.write_text("")
    log_path = tmp_path / "killed.log"
    process, log = _start_genrun(_args(prompts, out, on_cluster), env, log_path)
    try:
        _wait_generating(process, out, log_path)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        kill_group(process)
        log.close()
    ray_head.gate.unlink()
    committed = sum(len(committed_keys(out, shard)) for shard in _shards(out))
    assert committed == SHARDS * GATE_FROM and not (out / "trajectories.pkl").exists()

    # The head goes down hard and comes back on the same port.
    ray_head.kill9()
    print(f"ray head restarted in {ray_head.start():.1f} s")
    again = run_genrun(_args(prompts, out, on_cluster), env=env, timeout=300)
    print(f"run after the head's restart: exit {again.returncode}\n{again.stdout[-800:]}")
    assert again.returncode == 0, again.stderr[-3000:]
    # An end-to-end run on the separately started head (issue 8): no local Ray of its own.
    assert "Started a local Ray instance" not in again.stderr
    assert f"trajectories:  {PROMPTS} ({PROMPTS - committed} generated by this invocation)" in again.stdout
    _assert_exactly_once(out)
