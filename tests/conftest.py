"""Shared fixtures: isolated caches, the bundled model, small prompt files, a local Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parent.parent
GENRUN = [sys.executable, "-m", "flows.cli"]


SESSION_ENV: dict[str, str] = {}
"""The environment as the session began, before any test's monkeypatching: what session-wide
servers start with and hand to the tests."""


@pytest.fixture(scope="session", autouse=True)
def isolated_environment(tmp_path_factory):
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets"))
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    SESSION_ENV.update(os.environ)
    yield


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from generation_core.config.bundled import prepare_bundled_model

    return prepare_bundled_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised two-layer Llama: loads and decodes in milliseconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def chat_rows(count: int, first_index: int = 0) -> list[dict]:
    topics = ["the sea", "a cat", "rain", "mountains", "coffee", "a robot", "the moon", "trees"]
    return [
        {
            "data_source": "test",
            "prompt": [
                {"role": "user", "content": f"Write one short sentence about {topics[i % len(topics)]} (#{i})."}
            ],
            "ability": "chat",
            "reward_model": {"style": "none", "ground_truth": ""},
            "extra_info": {"split": "test", "index": first_index + i},
        }
        for i in range(count)
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    return write_parquet(tmp_path / "prompts.parquet", chat_rows(12))


@pytest.fixture
def wandb_offline_dir(tmp_path, monkeypatch) -> Path:
    """W&B in offline mode writing under this test's own folder. W&B keeps its settings (the
    directory among them) in a process-wide singleton built by the first run, so it is torn
    down after the test: the next test's WANDB_DIR would otherwise be ignored."""
    import wandb

    wandb_dir = tmp_path / "wandb-offline"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    wandb.teardown()
    yield wandb_dir
    wandb.teardown()


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        object_store_memory=128 * 1024 * 1024,
        namespace="genrun-tests",
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


def run_genrun(args: list[str], *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in its own process group (so nothing outlives the test)."""
    full_env = dict(os.environ, **(env or {}))
    process = subprocess.Popen(
        GENRUN + args,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        kill_group(process)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def kill_group(process: subprocess.Popen, grace: float = 10) -> None:
    """Stop a process and everything it started (its session): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace)
            if sig == signal.SIGTERM:
                # The leader is gone; make sure no child of the group lingers.
                os.killpg(process.pid, signal.SIGKILL)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        break
    process.wait(timeout=30)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrefectServer:
    def __init__(self, url: str, env: dict):
        self.url, self.env = url, env

    def api(self, method: str, path: str, **kwargs):
        import httpx

        response = httpx.request(method, f"{self.url}{path}", timeout=30, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None

    def wait_for_flow_run(self, flow_run_id: str, final_types: set[str], timeout: float = 420) -> dict:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.api("GET", f"/flow_runs/{flow_run_id}")
            if run["state"]["type"] in final_types:
                return run
            time.sleep(1)
        raise AssertionError(f"flow run {flow_run_id} did not reach {final_types}: {run['state']}")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real Prefect server on 127.0.0.1 with its own database, stopped by PID at the end. One
    for the whole session (each start costs ~15 s on 2 cores): tests find their own flow runs
    by output folder or id, never by being alone on it."""
    import time

    import httpx

    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {k: v for k, v in SESSION_ENV.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PYTHONPATH=str(REPO),
    )
    log = open(home / "server.log", "w")
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield PrefectServer(url, dict(env, PREFECT_API_URL=url))
    finally:
        kill_group(process)
        log.close()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "genrun-test-key",
    "AWS_SECRET_ACCESS_KEY": "genrun-test-secret-value",
    "AWS_DEFAULT_REGION": "us-east-1",
    # No instance-metadata lookups: this machine has no route there and they would hang.
    "AWS_EC2_METADATA_DISABLED": "true",
}


def start_moto(log_path: Path, extra_env: dict | None = None):
    """A real S3 API (moto's server mode, as s3fs's own tests use) on 127.0.0.1."""
    import time

    import httpx

    port = free_port()
    env = dict(os.environ, **(extra_env or {}))
    log = open(log_path, "w")
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(endpoint, timeout=2)
            break
        except httpx.HTTPError:
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.3)
    return process, endpoint, log


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """Endpoint of a local S3 server holding the bucket `genrun-test`; stopped by PID at the end."""
    import s3fs

    process, endpoint, log = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        env = dict(S3_ENV, AWS_ENDPOINT_URL=endpoint)
        s3fs.S3FileSystem(
            endpoint_url=endpoint, key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"]
        ).mkdir("genrun-test")
        yield env
    finally:
        kill_group(process)
        log.close()
        # fsspec keeps S3 filesystems per process, keyed by their options, not by the endpoint
        # they took from AWS_ENDPOINT_URL: one made for this server must not serve a later test.
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def fresh_tokenizer_cache():
    """The run's tokenizer loads once per process (inputs/tokenizer.py): a test that watches the
    loading (patching verl's `hf_tokenizer`) must see a load of its own, and must leave no patched
    tokenizer behind for the tests after it in this worker."""
    from generation_core.inputs.tokenizer import _load

    _load.cache_clear()
    yield
    _load.cache_clear()
