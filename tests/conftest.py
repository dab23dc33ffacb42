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
GENRUN = [sys.executable, "-m", "generation_core.cli"]


@pytest.fixture(scope="session", autouse=True)
def isolated_environment(tmp_path_factory):
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets"))
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    yield


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from generation_core.bundled import prepare_bundled_model

    return prepare_bundled_model()


def chat_rows(count: int, first_index: int = 0) -> list[dict]:
    topics = ["the sea", "a cat", "rain", "mountains", "coffee", "a robot", "the moon", "trees"]
    return [
        {
            "data_source": "test",
            "prompt": [{"role": "user", "content": f"Write one short sentence about {topics[i % len(topics)]} (#{i})."}],
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


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=128 * 1024 * 1024, namespace="genrun-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


def run_genrun(args: list[str], *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in its own process group (so nothing outlives the test)."""
    full_env = dict(os.environ, **(env or {}))
    process = subprocess.Popen(GENRUN + args, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        kill_group(process)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)
