"""The engine replica's process on the CPU: it runs at normal priority (Ray starts workers at
nice 15) and the node's usable cores are shared by the replicas on it, not given to each."""

from __future__ import annotations

import asyncio
import os

import pytest

from generation_core.engines import server
from tests.conftest import chat_rows, write_parquet

pytestmark = pytest.mark.timeout(300)


def test_threads_are_the_usable_cores_shared_by_the_replicas_on_the_node(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [server.cpu_threads_per_replica(n) for n in (1, 2, 3, 16, 40)] == [16, 8, 5, 1, 1]


def test_two_cpu_replicas_split_the_cores_and_run_at_normal_priority(tmp_path, ray_local):
    from generation_core.preflight.preflight import preflight
    from generation_core.serving.pool import ReplicaPool

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(2))
    plan = preflight(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.n_gpus_per_node=2",
            "generation.show_progress=false",
        ]
    )

    async def health():
        pool = await ReplicaPool.boot(plan.cfg)
        try:
            return await pool.check_health()
        finally:
            pool.shutdown()

    answers = asyncio.run(health())
    assert len(answers) == 2
    cores = len(os.sched_getaffinity(0))
    assert [a["torch_threads"] for a in answers] == [max(1, cores // 2)] * 2
    ray_worker_nice = ray_local.get(ray_local.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote())
    assert ray_worker_nice > 0, "Ray starts its workers below normal priority (what the engine undoes)"
    if os.geteuid() == 0:
        assert [a["nice"] for a in answers] == [0, 0], "the engines left Ray's nice 15"
    else:
        # Without CAP_SYS_NICE the engine keeps Ray's level (and says so in its log).
        assert all(a["nice"] >= 0 for a in answers)


def _heavy_modules_loaded(actor_self) -> list[str]:
    import sys

    return sorted(name for name in ("verl", "tensordict", "torch", "transformers") if name in sys.modules)


def test_the_instant_engines_replica_process_imports_no_verl_torch_or_transformers(tmp_path, ray_local):
    """The replica process loads its engine's module and what it imports: for the instant engine
    none of verl (tensordict, torch._dynamo), torch or transformers, seconds of CPU in every run
    (its answers reach the agent loops as verl's TokenOutput all the same: test_request_batching)."""
    from generation_core.preflight.preflight import preflight
    from generation_core.serving.pool import ReplicaPool

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(2))
    plan = preflight(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "actor_rollout_ref.rollout.name=instant",
            "generation.show_progress=false",
        ]
    )

    async def modules_and_answer():
        pool = await ReplicaPool.boot(plan.cfg)
        try:
            (handle,) = pool.manager.server_handles
            loaded = await handle.__ray_call__.remote(_heavy_modules_loaded)
            client = pool.client()
            answer = await client.generate(
                "r1", prompt_ids=[5, 6, 7], sampling_params={"temperature": 0.0, "logprobs": True}
            )
            await client.aclose()
            return loaded, answer
        finally:
            pool.shutdown()

    loaded, answer = asyncio.run(modules_and_answer())
    assert loaded == []
    from verl.workers.rollout.replica import TokenOutput

    assert isinstance(answer, TokenOutput)
    assert len(answer.token_ids) == 8 and answer.log_probs == [-1.0] * 8 and answer.stop_reason == "stop"
    assert answer.extra_fields == {"min_global_steps": None, "max_global_steps": None}
