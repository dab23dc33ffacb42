"""The transformers engine as a verl RolloutReplica named `hf`, served by a Ray actor.

Registering it in verl's RolloutReplicaRegistry lets verl's own LLMServerManager boot it and
verl's LLMServerClient route to it, exactly as it does for `sglang` and `vllm`: the CPU tests
exercise the same pool and client code as production GPU runs.
"""

from __future__ import annotations

import os
import uuid

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from generation_core.engines.hf import EngineSettings, HFEngine

SERVER_NAME_PREFIX = "genrun_hf_server"


class HFServer:
    """Ray actor body: one engine, many concurrent `generate` calls (an async actor)."""

    def __init__(self, settings: EngineSettings):
        self.engine = HFEngine(settings)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return await self.engine.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)

    def health(self) -> dict:
        return dict(self.engine.stats, alive=self.engine._thread.is_alive())

    # verl's replica API: weights never change during generation, so these are no-ops.
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()


class HFReplica(RolloutReplica):
    """verl replica for the transformers engine; only standalone mode (no training engine)."""

    async def init_standalone(self):
        self.rollout_mode = RolloutMode.STANDALONE
        hf_kwargs = dict(self.config.engine_kwargs.get("hf", {}) or {})
        settings = EngineSettings(
            model_path=os.path.expanduser(self.model_config.path),
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            max_batch_size=self.config.max_num_seqs,
            num_threads=hf_kwargs.get("num_threads") or os.cpu_count(),
            trust_remote_code=bool(self.model_config.get("trust_remote_code", False)),
        )
        name = f"{SERVER_NAME_PREFIX}_{self.replica_rank}{self.name_suffix}_{uuid.uuid4().hex[:8]}"
        # num_cpus=0: the engine's threads are sized by num_threads, and holding a Ray CPU
        # would starve shard tasks on a small machine.
        server = (
            ray.remote(HFServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency, max_restarts=0)
            .remote(settings)
        )
        await server.health.remote()
        self._server_handle = server
        self._server_address = name
        self.servers = [server]

    async def launch_servers(self):
        raise NotImplementedError("the hf engine runs standalone only (rollout.name=hf in a generation run)")


RolloutReplicaRegistry.register("hf", lambda: HFReplica)
