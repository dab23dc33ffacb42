"""Our engines as verl RolloutReplicas (`hf`, `instant`), each served by one Ray actor.

Registering them in verl's RolloutReplicaRegistry lets verl's own LLMServerManager boot them
and the routing client (routing.py) call their server actors exactly as it calls `sglang` and
`vllm` replicas: the CPU tests exercise the same pool and client code as production GPU runs.
An EngineServer serves the engine contract (engines/base.py) of the engine it holds.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Callable

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from generation_core.engines import hf, instant
from generation_core.engines.base import Engine
from generation_core.instrumentation import mark
from generation_core.request_batching import serve_batch


ENGINE_RESTARTS = 3


class EngineServer:
    """Ray actor body: one engine, many concurrent `generate` calls (an async actor)."""

    def __init__(self, build_engine: Callable[[], Engine]):
        # Runs again when Ray restarts a crashed engine actor.
        self.engine = build_engine()
        mark("replica_ready")

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return await self.engine.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)

    async def serve_batch(self, requests: list[dict]):
        """Many `generate` calls in one Ray call, answered as they finish (request_batching.py)."""
        async for answers in serve_batch(self.generate, requests):
            yield answers

    def health(self) -> dict:
        return dict(self.engine.stats, pid=os.getpid())

    # verl's replica API: weights never change during generation, so these are no-ops.
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()


class _EngineReplica(RolloutReplica):
    """A verl replica whose server is one EngineServer actor; standalone mode only."""

    engine_name = ""

    def build_engine(self) -> Callable[[], Engine]:
        raise NotImplementedError

    def gpus(self) -> int:
        """GPUs the engine actor holds (Ray then sets its CUDA_VISIBLE_DEVICES)."""
        return 0

    async def init_standalone(self):
        self.rollout_mode = RolloutMode.STANDALONE
        name = f"genrun_{self.engine_name}_server_{self.replica_rank}{self.name_suffix}_{uuid.uuid4().hex[:8]}"
        # num_cpus=0: the engine sizes its own threads, and holding a Ray CPU would starve the
        # shard tasks on a small machine. A GPU engine holds its GPU, so Ray places it on a GPU node. max_restarts: a crashed engine process is started
        # again (model loaded again) under the same handle; the clients fail over meanwhile.
        # No task retries: the clients resend a failed request themselves.
        server = (
            ray.remote(EngineServer)
            .options(name=name, num_cpus=0, num_gpus=self.gpus(), max_concurrency=self.max_concurrency, max_restarts=ENGINE_RESTARTS, max_task_retries=0)
            .remote(self.build_engine())
        )
        await server.health.remote()
        self._server_handle = server
        self._server_address = name
        self.servers = [server]

    async def launch_servers(self):
        raise NotImplementedError(f"the {self.engine_name} engine runs standalone only (a generation run)")


class HFReplica(_EngineReplica):
    engine_name = "hf"

    def gpus(self) -> int:
        return int(self._device().startswith("cuda"))

    def _device(self) -> str:
        hf_kwargs = self.config.engine_kwargs.get("hf", {}) or {}
        # RolloutConfig has no trainer.device: the driver's resolution (layout.hf_device) put it here.
        return hf_kwargs.get("device") or "cpu"

    def build_engine(self) -> Callable[[], Engine]:
        hf_kwargs = dict(self.config.engine_kwargs.get("hf", {}) or {})
        device = self._device()
        # bfloat16 on a GPU (what SGLang/vLLM serve), float32 on the CPU (bf16 matmuls are slow there).
        dtype = hf_kwargs.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        settings = hf.EngineSettings(
            model_path=os.path.expanduser(self.model_config.path),
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            max_batch_size=self.config.max_num_seqs,
            num_threads=hf_kwargs.get("num_threads") or os.cpu_count(),
            device=device,
            dtype=dtype,
            ignore_eos=bool(hf_kwargs.get("ignore_eos", False)),
            trust_remote_code=bool(self.model_config.get("trust_remote_code", False)),
        )
        return lambda: hf.HFEngine(settings)


class InstantReplica(_EngineReplica):
    engine_name = "instant"

    def build_engine(self) -> Callable[[], Engine]:
        instant_kwargs = dict(self.config.engine_kwargs.get("instant", {}) or {})
        model_config = json.loads((Path(os.path.expanduser(self.model_config.path)) / "config.json").read_text())
        eos = model_config.get("eos_token_id", 2)
        settings = instant.InstantSettings(
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            response_tokens=int(instant_kwargs.get("response_tokens", 8)),
            delay_seconds=float(instant_kwargs.get("delay_seconds", 0.0)),
            vocab_size=int(model_config.get("vocab_size", 1000)),
        )
        return lambda: instant.InstantEngine(settings)


GENRUN_ENGINES = {"hf": HFReplica, "instant": InstantReplica}
for _name, _replica in GENRUN_ENGINES.items():
    RolloutReplicaRegistry.register(_name, lambda replica=_replica: replica)
