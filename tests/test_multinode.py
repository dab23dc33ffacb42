"""A real multi-node Ray cluster on this machine: a head and two worker nodes, each its own
`ray start` (its own raylet, object store and workers, distinct custom resources), with input and
output on S3 (the local moto server), as `infra/ray/cluster.yaml` lays a cluster out. Shard tasks
must spread over the nodes and the merged result must equal a one-node run of the same overrides.

The nodes are stopped by the PIDs of their process trees, never by `ray stop` (that stops every
Ray of this user on the machine, other tests' included)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import psutil
import pytest
from verl.protocol import DataProto

from generation_core.driver.in_process import run_in_process
from generation_core.preflight.preflight import preflight
from tests.conftest import REPO, chat_rows, free_port, run_genrun, write_parquet
from tests.test_flow import _assert_same_dataproto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RAY = str(Path(sys.executable).parent / "ray")
SHARDS = 6
PROMPTS = 30


class RayNode:
    """One `ray start --block` in its own session; its log says when it is up."""

    def __init__(self, args: list[str], log_path: Path, env: dict):
        self.log_path = log_path
        with open(log_path, "w") as log:
            command = [
                RAY,
                "start",
                "--block",
                "--node-ip-address=127.0.0.1",
                "--disable-usage-stats",
                "--num-cpus=1",
                *args,
            ]
            self.process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_started(self, deadline: float) -> None:
        while "Ray runtime started" not in self.log_path.read_text():
            assert self.process.poll() is None and time.monotonic() < deadline, self.log_path.read_text()[-3000:]
            time.sleep(0.2)

    def kill(self) -> None:
        """kill -9 of the node's whole tree (raylet, GCS on the head, its Ray workers)."""
        try:
            root = psutil.Process(self.process.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
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


def _alive_nodes(address: str, env: dict) -> int:
    probe = (
        f"import ray; ray.init(address={address!r}, log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def ray_cluster(tmp_path, s3_server):
    """The head (node_head) and two workers (node_a, node_b), one Ray CPU each: at most one shard
    task per node at a time, so six shards cannot all run where the driver is. Every node reaches
    S3 with credentials of its own environment (on a real cluster: an instance role), as genrun
    forwards no credentials to the processes of a cluster it did not start."""
    # Unix socket paths under the temp dir must stay short (108 bytes).
    temp_dir = Path(tempfile.mkdtemp(prefix="mn", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(s3_server, RAY_AUTH_MODE="disabled")
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes: list[RayNode] = []
    try:
        deadline = time.monotonic() + 120
        head_args = [
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            "--object-store-memory=100000000",
            '--resources={"node_head": 1}',
        ]
        nodes.append(RayNode(head_args, tmp_path / "ray-head.log", env))
        nodes[0].wait_started(deadline)
        # One at a time: two raylets of one IP that register at once can miss their own node info.
        for name in ("node_a", "node_b"):
            worker_args = [f"--address={address}", "--object-store-memory=100000000", f'--resources={{"{name}": 1}}']
            nodes.append(RayNode(worker_args, tmp_path / f"ray-{name}.log", env))
            nodes[-1].wait_started(deadline)
        assert _alive_nodes(address, env) == 3
        yield address
    finally:
        for node in reversed(nodes):
            node.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _args(prompts: str, out: str, *extra: str) -> list[str]:
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "generation.show_progress=false",
        "generation.save_batch_size=2",
        f"generation.num_shards={SHARDS}",
        *extra,
    ]


def _load(fs, url: str):
    import pickle

    with fs.open(url, "rb") as handle:
        return pickle.load(handle)


# Extended (make test-all): a three-node cluster costs CI over a minute; make test holds the shards' spread over
# Ray workers and S3 input and output on one node (tests/test_many_shards.py, tests/test_s3.py).
@pytest.mark.extended
def test_shards_spread_over_a_three_node_cluster_with_s3_input_and_output(
    ray_cluster, s3_server, prefect_server, ray_local, tmp_path, monkeypatch
):
    fs = fsspec.filesystem(
        "s3",
        endpoint_url=s3_server["AWS_ENDPOINT_URL"],
        key=s3_server["AWS_ACCESS_KEY_ID"],
        secret=s3_server["AWS_SECRET_ACCESS_KEY"],
        use_listings_cache=False,
    )
    local_prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(PROMPTS))
    prompts = "s3://genrun-test/inputs/multinode/prompts.parquet"
    fs.put_file(str(local_prompts), prompts)
    env = dict(prefect_server.env, **s3_server)

    on_cluster = "s3://genrun-test/runs/multinode"
    clock = time.monotonic()
    result = run_genrun(_args(prompts, on_cluster, f"ray_kwargs.ray_init.address={ray_cluster}"), env=env, timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"on the cluster: {time.monotonic() - clock:.1f} s")
    assert "Started a local Ray instance" not in result.stderr
    assert f"trajectories:  {PROMPTS} " in result.stdout

    markers = [json.loads(fs.cat_file(f"{on_cluster}/shards/shard-{i:05d}/_SUCCESS.json")) for i in range(SHARDS)]
    workers = [m["last_attempt"]["worker"] for m in markers]
    nodes = {w["node_id"] for w in workers}
    print("shard -> node:", [w["node_id"][:8] for w in workers])
    assert None not in nodes and len(nodes) >= 2, f"every shard ran on one node: {workers}"
    summary = json.loads(fs.cat_file(f"{on_cluster}/manifest.json"))
    assert sum(s["samples"] for s in summary["shards"]) == PROMPTS

    # The same overrides on one node (this process's local Ray, the shards one after another).
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    clock = time.monotonic()
    run_in_process(preflight(_args(prompts, str(tmp_path / "one-node"))))
    print(f"on one node: {time.monotonic() - clock:.1f} s")
    _assert_same_dataproto(
        _load(fs, f"{on_cluster}/trajectories.pkl"),
        DataProto.load_from_disk(str(tmp_path / "one-node" / "trajectories.pkl")),
    )
